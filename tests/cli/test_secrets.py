"""No error path prints a secret.

Credentials written into a dataset URL (``s3://KEY:SECRET@bucket/ds``, with the ``/`` and
``+`` real AWS secrets hold), into an endpoint URL (``AWS_ENDPOINT_URL=http://KEY:SECRET@host``,
``storage_options["endpoint"]``), or in a signed URL's query string are refused at once with a
typed error; and no output of any command or API (stdout, stderr, the exception's ``str`` and
``repr`` and those of its chain) holds 8 consecutive characters of any secret.
"""

from __future__ import annotations

import contextlib
import io
import time
import urllib.parse

import numpy as np
import pytest

pytest.importorskip("obstore")

from zerobatch.formats.errors import ConfigError, ZerobatchError  # noqa: E402

KEY = "AKIAIOSFODNN7EXAMPLE"
SECRETS = [
    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",     # 40 characters, as AWS makes them
    "Secret+Part1/Rest2",
    "Zq9+Xx8pQ2rTnN3kLm0vWb7CdEeFfGgHhIiJjKkL",
    "pa:ss@w0rd#with?odd&chars=1",
]


def _leaks(text: str) -> list[str]:
    """The 8-character pieces of any secret (or of its percent-encoding) in ``text``."""
    found = []
    for secret in SECRETS + [urllib.parse.quote(s, safe="") for s in SECRETS] + [KEY]:
        for i in range(len(secret) - 7):
            if secret[i:i + 8] in text:
                found.append(secret[i:i + 8])
    return found


def _urls(secret: str) -> list[str]:
    quoted = urllib.parse.quote(secret, safe="")
    # ``s3://a/b@bucket/ds`` (a token holding a '/', no ':') is by URL grammar the bucket
    # ``a`` and the key ``b@bucket/ds``: no user information to find, and not a form anyone
    # writes credentials in; a token without '/' is
    token = [f"s3://{secret}@bucket/ds"] if "/" not in secret else []
    return token + [
        f"s3://{KEY}:{secret}@bucket/ds",
        f"s3://{KEY}:{quoted}@bucket/ds",
        f"gs://{KEY}:{secret}@bucket/ds",
        f"az://{KEY}:{secret}@container/ds",
        f"https://{KEY}:{secret}@127.0.0.1:9/ds",
        f"file://{KEY}:{secret}@host/tmp/ds",
        f"r2://{KEY}:{secret}@bucket/ds",          # a scheme zerobatch does not know: a local path to it
    ]


ALL_URLS = [u for s in SECRETS for u in _urls(s)]


def _chain(exc: BaseException) -> str:
    out = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out += [str(e), repr(e)]
        # what a traceback shows: the cause, or the context unless `from None` suppressed it
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return "\n".join(out)


def _cli(*argv: str) -> tuple[int, str]:
    from zerobatch.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue() + err.getvalue()


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "ZEROBATCH_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def npy(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "t.npy"
    np.save(path, np.arange(1, 2000, dtype=np.uint16))
    return str(path)


COMMANDS = [("inspect", "{url}"), ("verify", "{url}"), ("head", "{url}"), ("stats", "{url}"),
            ("convert", "{url}", "out", "--to", "tokstream"),
            ("convert", "{npy}", "{url}", "--to", "tokstream", "--eod-id", "0"),
            ("convert", "{npy}", "{url}", "--to", "llmbatch", "--eod-id", "0"),
            ("convert", "{npy}", "{url}", "--to", "tokstream", "--eod-id", "0", "--task", "0", "--tasks", "2"),
            ("commit", "{url}")]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c).replace("{", "").replace("}", ""))
def test_no_command_prints_a_secret_written_into_a_dataset_url(command, npy):
    for url in ALL_URLS:
        argv = [a.format(url=url, npy=npy) for a in command]
        t0 = time.monotonic()
        rc, text = _cli(*argv)
        assert rc != 0, (argv, text)
        assert not _leaks(text), (argv, text, _leaks(text))
        assert "internal error" not in text, text
        assert time.monotonic() - t0 < 5, f"{argv}: refused only after {time.monotonic() - t0:.1f} s"


@pytest.mark.parametrize("secret", SECRETS)
def test_an_endpoint_url_with_credentials_is_refused_at_once(secret, monkeypatch):
    from zerobatch.core.remote import ObjectStore
    from zerobatch.readers.tokstream import TokenStreamReader
    for endpoint in (f"http://{KEY}:{secret}@127.0.0.1:9", f"https://{KEY}:{urllib.parse.quote(secret)}@host"):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        t0 = time.monotonic()
        rc, text = _cli("inspect", "s3://bucket/ds")
        assert rc == 1 and "AWS_ENDPOINT_URL" in text and "user information" in text, text
        assert not _leaks(text) and "internal error" not in text, text
        assert time.monotonic() - t0 < 2, text
        with pytest.raises(ConfigError) as info:
            TokenStreamReader("s3://bucket/ds")
        assert not _leaks(_chain(info.value))
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        with pytest.raises(ConfigError) as info:
            ObjectStore("s3://bucket/ds", {"endpoint": endpoint})
        assert info.value.field == "storage_options['endpoint']" and not _leaks(_chain(info.value))


def test_no_api_prints_a_secret_written_into_a_url(tmp_path):
    from zerobatch.adapters.sources.tokstream import TokenWindows
    from zerobatch.core.remote import ObjectStore, redact, split_url
    from zerobatch.readers.llmbatch import BatchFileReader
    from zerobatch.readers.tokstream import TokenStreamReader
    from zerobatch.writers.remote import publish_tokstream
    from zerobatch.writers.tokstream import TokenStreamWriter
    with TokenStreamWriter(tmp_path / "ds", vocab_size=10) as w:
        w.add_document([1, 2, 3])
    import pathlib
    calls = [TokenStreamReader, lambda u: TokenStreamReader(pathlib.Path(u)),   # a Path folds '//' to '/'
             lambda u: BatchFileReader(u), lambda u: TokenWindows(u, 4), ObjectStore, split_url,
             lambda u: TokenStreamWriter(u, vocab_size=10), lambda u: publish_tokstream(tmp_path / "ds", u)]
    for url in ALL_URLS:
        for call in calls:
            with pytest.raises(ZerobatchError) as info:
                call(url)
            assert not _leaks(_chain(info.value)), (url, _chain(info.value))
        assert not _leaks(redact(url)), redact(url)


def test_signed_urls_keep_their_signature_out_of_messages(tmp_path):
    from zerobatch.core.remote import ObjectStore
    secret = SECRETS[0]
    url = f"https://127.0.0.1:9/ds?X-Amz-Signature={urllib.parse.quote(secret, safe='')}&sv=1"
    store = ObjectStore(url)
    assert not _leaks(repr(store))
    rc, text = _cli("inspect", url)
    assert rc == 1 and not _leaks(text), text
    err = ZerobatchError(f"failed to fetch {url}", path=url)
    assert not _leaks(str(err)) and "?***" in str(err)
