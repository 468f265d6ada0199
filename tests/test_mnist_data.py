"""The example's MNIST reader: strict IDX parsing, both file-name spellings, checked download, digits fallback."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import threading

import numpy as np
import pytest
from tiny_mnist import md, write_tiny_mnist


@pytest.mark.parametrize("dotted, gz", [(False, True), (False, False), (True, False), (True, True)])
def test_reads_every_spelling(tmp_path, dotted, gz):
    write_tiny_mnist(tmp_path, dotted=dotted, gz=gz)
    ds = md.load_mnist(tmp_path)
    assert ds.train_images.shape == (64, 28, 28, 1) and ds.train_images.dtype == np.float32
    assert ds.test_labels.shape == (32,) and ds.test_labels.dtype == np.int32
    assert 0.0 <= ds.train_images.min() and ds.train_images.max() <= 1.0


def test_roundtrip_values(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    md.write_idx(tmp_path / "x.gz", arr)
    np.testing.assert_array_equal(md.read_idx(tmp_path / "x.gz"), arr)


def test_truncated_file_is_an_error(tmp_path):
    write_tiny_mnist(tmp_path, gz=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(md.DatasetError, match=r"truncated: header says shape \(64, 28, 28\)"):
        md.load_mnist(tmp_path)


def test_trailing_bytes_and_bad_magic_are_errors(tmp_path):
    good = tmp_path / "a"
    md.write_idx(good, np.zeros((2, 2), np.uint8))
    good.write_bytes(good.read_bytes() + b"x")
    with pytest.raises(md.DatasetError, match="has trailing bytes"):
        md.read_idx(good)
    bad = tmp_path / "b"
    bad.write_bytes(b"PK\x03\x04rest")
    with pytest.raises(md.DatasetError, match="not an IDX file"):
        md.read_idx(bad)
    corrupt = tmp_path / "c.gz"
    corrupt.write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x05abcde")[:-6])
    with pytest.raises(md.DatasetError, match="cannot read"):
        md.read_idx(corrupt)


def test_mismatched_images_and_labels(tmp_path):
    write_tiny_mnist(tmp_path)
    md.write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(10, np.uint8))
    with pytest.raises(md.DatasetError, match=r"train images \(64, 28, 28\) and labels \(10,\) do not match"):
        md.load_mnist(tmp_path)


def test_missing_mnist_falls_back_to_digits(tmp_path, capsys):
    ds = md.load_dataset("auto", tmp_path)
    assert ds.name == "digits" and ds.train_images.shape[1:] == (28, 28, 1)
    assert len(ds.train_labels) + len(ds.test_labels) == 1797
    assert "training on scikit-learn's bundled digits" in capsys.readouterr().out
    with pytest.raises(md.DatasetError, match="MNIST not found"):
        md.load_dataset("mnist", tmp_path)


def test_download_checks_checksums_and_tries_mirrors(tmp_path, monkeypatch):
    """A loopback server plays two mirrors: the first serves a corrupt file, the second the right one."""
    served = tmp_path / "served"
    write_tiny_mnist(served)
    files = {}
    for role, (name, _) in md.FILES.items():
        payload = (served / name).read_bytes()
        files[role] = (name, hashlib.md5(payload).hexdigest())
    monkeypatch.setattr(md, "FILES", files)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            mirror, name = self.path.strip("/").split("/")
            body = (served / name).read_bytes()
            if mirror == "bad":
                body = body[:20] + bytes([body[20] ^ 0xFF]) + body[21:]
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setattr(md, "MIRRORS", (f"{base}/bad/", f"{base}/good/"))
        md.download_mnist(tmp_path / "dl", timeout=10)
        ds = md.load_dataset("mnist", tmp_path / "dl")
        assert ds.name == "mnist" and len(ds.train_labels) == 64
        monkeypatch.setattr(md, "MIRRORS", (f"{base}/bad/",))
        with pytest.raises(md.DatasetError, match="checksum mismatch"):
            md.download_mnist(tmp_path / "dl2", timeout=10)
        assert not any((tmp_path / "dl2").glob("*.gz"))  # nothing half-written under a real name
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
