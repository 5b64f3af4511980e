"""``aiayn fetch wmt14`` against small WMT14-shaped archives served from 127.0.0.1 or file://
(nothing here reaches the internet): the join's order and paths, the test sets, the checks
(size, sha256, line counts, member paths), resuming, and a re-run that does nothing."""

from __future__ import annotations

import http.server
import json
import tarfile
import threading
from functools import partial
from pathlib import Path

import pytest
from test_wmt14_recipe import _synthetic  # tests/integration is on sys.path

from aiayn.cli import main
from aiayn.data.fetch import WMT14, load_manifest, segments, stream_members
from aiayn.errors import DataError

ROOT = Path(__file__).resolve().parents[2]


class Server:
    """Serves a folder on 127.0.0.1 with HTTP Range support (``ranges=False``: ignores Range
    and sends the whole file, as some servers do); records each request's path and Range."""

    def __init__(self, root: Path, ranges: bool = True) -> None:
        self.requests: list[tuple[str, str | None]] = []
        requests = self.requests

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                header = self.headers.get("Range")
                requests.append((self.path, header))
                path = Path(self.translate_path(self.path))
                if not (ranges and header and path.is_file()):
                    return super().do_GET()
                data = path.read_bytes()
                start = int(header.removeprefix("bytes=").split("-")[0])
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                self.wfile.write(data[start:])

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def archives(tmp_path):
    """(folder of the fake archives, path of their manifest, the manifest)."""
    www = tmp_path / "www"
    manifest = _synthetic().write_wmt14_archives(www, (60, 30, 10), (7, 9))
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest), encoding="utf-8")
    return www, path, manifest


def _fetch(capsys, out: Path, mirror: str, manifest: Path, *extra: str) -> tuple[int, str, str]:
    code = main(["fetch", "wmt14", "-o", str(out), "--mirror", mirror, "--manifest",
                 str(manifest), "--test-dir", str(out / "data" / "wmt14-en-de"),
                 "--no-progress", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _member(archive: Path, name: str) -> bytes:
    with tarfile.open(archive) as tar:
        return tar.extractfile(name).read()


def test_fetch_joins_in_order_writes_the_test_sets_and_a_rerun_does_nothing(archives, tmp_path,
                                                                             capsys):
    www, manifest_path, manifest = archives
    out = tmp_path / "wmt14"
    with Server(www) as server:
        code, stdout, _ = _fetch(capsys, out, server.url, manifest_path, "--json")
        assert code == 0
        result = json.loads(stdout)
        assert result["fetched"] is True
        assert [a["how"] for a in result["archives"]] == ["downloaded"] * 4
        for lang in ("en", "de"):  # the manifest's order, the manifest's member paths
            expected = b"".join(_member(www / c["archive"], c["files"][lang])
                                for c in manifest["train"])
            assert (out / f"train.{lang}").read_bytes() == expected
            assert result["train"][lang]["lines"] == 100
        test_dir = out / "data" / "wmt14-en-de"
        sgm = _member(www / "dev.tgz", "dev/newstest2014-deen-ref.de.sgm").decode()
        lines = (test_dir / "newstest2014.de").read_text(encoding="utf-8").splitlines()
        assert len(lines) == 9 and lines[0] in sgm and lines[0] == lines[0].strip()
        assert len((test_dir / "newstest2013.en").read_text().splitlines()) == 7
        assert sorted(p.name for p in (out / "downloads").iterdir()) == sorted(
            a["name"] for a in manifest["archives"])  # no .part left
        stamp = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}

        requests = len(server.requests)
        code, stdout, _ = _fetch(capsys, out, server.url, manifest_path)
    assert code == 0 and len(server.requests) == requests  # nothing fetched again
    assert "nothing to do" in stdout
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamp


def test_a_changed_output_is_made_again_from_the_kept_archives(archives, tmp_path, capsys):
    www, manifest_path, _ = archives
    out = tmp_path / "wmt14"
    assert _fetch(capsys, out, www.as_uri(), manifest_path)[0] == 0
    joined = (out / "train.de").read_bytes()
    with open(out / "train.de", "ab") as f:
        f.write(b"one line more\n")
    code, stdout, _ = _fetch(capsys, out, www.as_uri(), manifest_path, "--json")
    assert code == 0
    result = json.loads(stdout)
    assert result["fetched"] and {a["how"] for a in result["archives"]} == {"kept"}
    assert (out / "train.de").read_bytes() == joined


def test_a_download_larger_than_its_archive_is_refused(archives, tmp_path, capsys):
    www, manifest_path, manifest = archives
    name = "dev.tgz"
    (www / name).write_bytes((www / name).read_bytes() + b"\0" * (3 << 20))
    out = tmp_path / "wmt14"
    with Server(www) as server:
        code, _, err = _fetch(capsys, out, server.url, manifest_path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "more than the" in err
    assert not (out / "downloads" / name).exists()
    assert not (out / "downloads" / f"{name}.part").exists()


def test_a_corrupted_download_is_refused_with_one_line(archives, tmp_path, capsys):
    www, manifest_path, manifest = archives
    bad = www / "training-parallel-commoncrawl.tgz"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    out = tmp_path / "wmt14"
    with Server(www) as server:
        code, _, err = _fetch(capsys, out, server.url, manifest_path)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "training-parallel-commoncrawl.tgz" in err and "sha256" in err and "removed" in err
    assert not (out / "train.en").exists()
    assert not any(p.name.startswith("training-parallel-commoncrawl") for p in
                   (out / "downloads").iterdir())  # neither under its name nor as .part


def test_an_interrupted_download_resumes_with_a_range_request(archives, tmp_path, capsys):
    www, manifest_path, manifest = archives
    out = tmp_path / "wmt14"
    name = "training-parallel-nc-v9.tgz"
    (out / "downloads").mkdir(parents=True)
    half = (www / name).read_bytes()[:1000]
    (out / "downloads" / f"{name}.part").write_bytes(half)
    with Server(www) as server:
        code, stdout, _ = _fetch(capsys, out, server.url, manifest_path, "--json")
    assert code == 0
    how = {a["name"]: a["how"] for a in json.loads(stdout)["archives"]}
    assert how[name] == "resumed"
    assert (f"/{name}", "bytes=1000-") in server.requests
    assert (out / "downloads" / name).read_bytes() == (www / name).read_bytes()


def test_a_server_that_ignores_range_gets_the_whole_file_again(archives, tmp_path, capsys):
    www, manifest_path, _ = archives
    out = tmp_path / "wmt14"
    name = "training-parallel-nc-v9.tgz"
    (out / "downloads").mkdir(parents=True)
    (out / "downloads" / f"{name}.part").write_bytes(b"x" * 1000)  # not even the right bytes
    with Server(www, ranges=False) as server:
        code, stdout, _ = _fetch(capsys, out, server.url, manifest_path, "--json")
    assert code == 0
    assert {a["name"]: a["how"] for a in json.loads(stdout)["archives"]}[name] == "downloaded"
    assert (out / "downloads" / name).read_bytes() == (www / name).read_bytes()


def test_file_urls_and_kept_test_files(archives, tmp_path, capsys):
    www, manifest_path, _ = archives
    out = tmp_path / "wmt14"
    test_dir = out / "data" / "wmt14-en-de"
    test_dir.mkdir(parents=True)
    mine = "".join(f"my line {i}\n" for i in range(7))
    (test_dir / "newstest2013.en").write_text(mine)
    code, stdout, _ = _fetch(capsys, out, www.as_uri(), manifest_path, "--json")
    assert code == 0
    how = {Path(t["path"]).name: t["how"] for t in json.loads(stdout)["test"]}
    assert how == {"newstest2013.en": "kept", "newstest2013.de": "written",
                   "newstest2014.en": "written", "newstest2014.de": "written"}
    assert (test_dir / "newstest2013.en").read_text() == mine


def test_a_test_file_with_other_lines_is_refused(archives, tmp_path, capsys):
    www, manifest_path, _ = archives
    out = tmp_path / "wmt14"
    test_dir = out / "data" / "wmt14-en-de"
    test_dir.mkdir(parents=True)
    (test_dir / "newstest2014.de").write_text("one line\n")
    code, _, err = _fetch(capsys, out, www.as_uri(), manifest_path)
    assert code == 2 and "newstest2014.de: already there with 1 lines" in err


def test_line_counts_are_checked(archives, tmp_path, capsys):
    www, manifest_path, manifest = archives
    manifest["train"][1]["lines"] += 1
    manifest_path.write_text(json.dumps(manifest))
    code, _, err = _fetch(capsys, tmp_path / "wmt14", www.as_uri(), manifest_path)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "Common Crawl has lines commoncrawl.de-en.en 30, commoncrawl.de-en.de 30" in err
    assert not (tmp_path / "wmt14" / "train.en").exists()


def test_an_unreachable_mirror_says_how_to_resume(archives, tmp_path, capsys):
    _, manifest_path, _ = archives
    with Server(tmp_path) as server:
        url = server.url  # a port that is closed once the server is gone
    code, _, err = _fetch(capsys, tmp_path / "wmt14", url, manifest_path)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "cannot download" in err and "run again to resume" in err


def test_members_outside_the_folder_or_missing_are_refused(tmp_path):
    import io

    archive = tmp_path / "a.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("../evil", "ok"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"x\n"))
        link = tarfile.TarInfo("link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    taken = []

    def take(name, handle, size):
        taken.append((name, handle.read()))

    for name in ("../evil", "link"):
        with pytest.raises(DataError, match="refused|not a regular file"):
            stream_members(archive, {name}, take)
    with pytest.raises(DataError, match="no member missing"):
        stream_members(archive, {"ok", "missing"}, take)
    stream_members(archive, {"ok"}, take)
    assert taken[-1] == ("ok", b"x\n")


def test_the_built_in_manifest_is_well_formed():
    manifest = load_manifest()
    assert [c.name for c in manifest.train] == ["Europarl v7", "Common Crawl",
                                                "News Commentary v9"]
    assert sum(c.lines for c in manifest.train) == 4_520_620
    assert all(len(a.sha256) == 64 and a.url.startswith("http://") for a in manifest.archives)
    assert load_manifest(WMT14).digest() == manifest.digest()
    with pytest.raises(DataError, match="not a fetch manifest"):
        load_manifest({"name": "x"})


def test_segments_tidy_whitespace_as_input_from_sgm():
    sgm = b'<doc>\n<seg id="1">  a\t b  </seg>\n<seg id="2">c\xc2\xa0d</seg>\n</doc>\n'
    assert segments(sgm, sgm=True) == [b"a b", b"c\xc2\xa0d"]  # a no-break space is kept
    assert segments(b" x  y \nz\n", sgm=False) == [b"x y", b"z"]
