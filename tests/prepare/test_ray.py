"""The Ray Data integration on a local Ray instance (ray.init(num_cpus=2)): Parquet read by
Ray Data, mapped, and written with zerobatch's TokenStreamDatasink, one part per write task,
committed on completion: the documents (and their ids as metadata) of the CLI's convert."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")
ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from zerobatch.prepare.pipeline import convert  # noqa: E402
from zerobatch.prepare.integrations.ray import TokenStreamDatasink  # noqa: E402
from zerobatch.cli.quickstart import bundled_text, train_tokenizer  # noqa: E402
from zerobatch.formats.errors import ConfigError  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader  # noqa: E402


def documents(path) -> list[list[int]]:
    with TokenStreamReader(path) as r:
        return [r.document(i).tolist() for i in range(r.num_documents)]


def test_a_ray_data_write_makes_the_documents_of_the_cli(tmp_path):
    text = bundled_text()[:80_000]
    docs = [p.strip() for p in text.split("\n\n") if p.strip()]
    (tmp_path / "t.txt").write_text(text)
    tok = str(tmp_path / "tokenizer.json")
    train_tokenizer(str(tmp_path / "t.txt"), 512, tok)
    src = tmp_path / "pq"
    src.mkdir()
    for k in range(4):
        part = docs[k::4]
        pq.write_table(pa.table({"text": part, "id": [f"{k}-{i}" for i in range(len(part))]}), src / f"{k}.parquet")
    cli = tmp_path / "cli"
    convert(str(src), str(cli), to="tokstream", tokenizer=tok, workers=1, quiet=True, log=lambda *_: None)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             object_store_memory=200 << 20)
    try:
        out = tmp_path / "ray"
        ds = ray.data.read_parquet(str(src)).map_batches(lambda b: b, batch_format="pyarrow")
        ds.write_datasink(TokenStreamDatasink(out, tok, shard_tokens=5000, metadata_columns=("id",)))
        got = documents(out)
        assert sorted(got) == sorted(documents(cli)) and len(got) == len(docs)
        with TokenStreamReader(out) as r:
            ids = [r.window_metadata(r.document_span(i)[0], 1).objects[0]["id"] for i in range(r.num_documents)]
        assert sorted(ids) == sorted(f"{k}-{i}" for k in range(4) for i in range(len(docs[k::4])))
        assert not (out / "_parts").exists()
        with pytest.raises(Exception) as e:        # a committed dataset is never written over
            ray.data.read_parquet(str(src)).write_datasink(TokenStreamDatasink(out, tok))
        assert "committed there already" in str(e.value) or isinstance(e.value, ConfigError)
    finally:
        ray.shutdown()
