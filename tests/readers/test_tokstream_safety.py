"""TOKSTREAM data safety (issue 17): metadata blobs are decoded by the spec's strict JSON
codec (no NaN, no duplicate keys), and ``verify()`` reports everything a read refuses
(metadata ids at or above the shard's metadata count, blobs that do not decode). The
datasets are made by the real writer with one step subverted, so every checksum is valid:
only the content lies."""

from __future__ import annotations

import numpy as np
import pytest

import zerobatch.writers.tokstream as W
from zerobatch.formats.errors import CorruptError
from zerobatch.readers.tokstream import TokenStreamReader

DOCS = [np.arange(1, 9, dtype=np.int64) + 10 * k for k in range(6)]


def write(folder, blobs=None, bad_id_doc=None):
    """Six documents with metadata ``{"doc": k}``; ``blobs`` replaces document k's blob with
    raw bytes, ``bad_id_doc`` makes that document's tokens name a metadata id past the end."""
    real = W.serialize_metadata

    def serialize(obj, codec):
        if blobs and obj.get("doc") in blobs:
            return blobs[obj["doc"]]
        return real(obj, codec)

    real_add = W.ShardWriter._add_metadata

    def add(self, obj):
        i = real_add(self, obj)
        return i + 1000 if obj.get("doc") == bad_id_doc else i

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(W, "serialize_metadata", serialize)
        mp.setattr(W.ShardWriter, "_add_metadata", add)
        with W.TokenStreamWriter(folder, vocab_size=100, metadata=True) as w:
            for k, d in enumerate(DOCS):
                w.add_document(d, {"doc": k})
    return folder


def test_a_clean_dataset_verifies_and_reads(tmp_path):
    with TokenStreamReader(write(tmp_path / "d")) as r:
        assert r.verify().ok
        md = r.windows_metadata([0, 8], 8)
        assert [md.objects[i] for i in range(len(md.objects))] == [{"doc": 0}, {"doc": 1}]


@pytest.mark.parametrize("blob", [b"NaN", b'{"doc":3,"doc":3}', b'{"x":Infinity}', b"\xff\xfe", b"{"])
def test_a_blob_the_strict_json_codec_refuses_is_refused_by_reads_and_by_verify(tmp_path, blob):
    with TokenStreamReader(write(tmp_path / "d", blobs={3: blob})) as r:
        report = r.verify()
        assert not report.ok
        assert any("metadata 3" in msg for _, msg in report.problems), report.problems
        with pytest.raises(CorruptError, match="metadata"):
            md = r.windows_metadata([24], 8)
            md.objects[0]


def test_a_metadata_id_past_the_shards_count_is_reported_by_verify(tmp_path):
    with TokenStreamReader(write(tmp_path / "d", bad_id_doc=2)) as r:
        report = r.verify()
        assert not report.ok
        assert any("metadata_id" in msg for _, msg in report.problems), report.problems
        with pytest.raises(CorruptError, match="metadata"):
            r.windows_metadata([16], 8)
