"""Pack a headline part's folder so that a device call brings it back whole (at most 8 files of 16 MiB each).

    python3 scripts/pack_gpu_out.py $OUT/workloads

In DIR: ``bench/`` (each ``twogrid bench --save-detailed`` result) becomes ``bench.tgz``, with the generated texts
left out and the inter-token latencies rounded to the microsecond (they were 80% of 36 MB for two 1024-stream
runs); ``traces/`` becomes ``traces.tgz``; the servers' logs ``server-*.log`` become ``logs.tgz``. An archive over
15 MiB is cut into ``NAME.00``, ``NAME.01``, ... (``cat NAME.* > NAME`` joins them). The originals are removed once
packed. Everything else in DIR (the headline JSON, its log and plot) stays as it is.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import shutil
import sys
import tarfile

PIECE_BYTES = 15 * 2**20
"""Archives above this are cut into pieces of this size (the device tool brings back files of up to 16 MiB)."""


def slim(result: dict) -> dict:
    """A bench result without its generated texts, its per-request inter-token latencies rounded to 1 us."""
    out = {k: v for k, v in result.items() if k != "generated_texts"}
    if isinstance(out.get("itls"), list):
        out["itls"] = [[round(x, 6) for x in itl] for itl in out["itls"]]
    return out


def _archive(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _write(directory: str, name: str, data: bytes) -> list[str]:
    """``data`` as ``name`` in ``directory``, or in pieces of PIECE_BYTES: the files written."""
    if len(data) <= PIECE_BYTES:
        paths = [os.path.join(directory, name)]
        pieces = [data]
    else:
        pieces = [data[i:i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)]
        paths = [os.path.join(directory, f"{name}.{i:02d}") for i in range(len(pieces))]
    for path, piece in zip(paths, pieces):
        with open(path, "wb") as f:
            f.write(piece)
    return paths


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _slim_json(path: str) -> bytes:
    with open(path) as f:
        return json.dumps(slim(json.load(f))).encode()


def _pack_files(directory: str, name: str, paths: list[str], prefix: str, read) -> list[str]:
    """``paths`` (each as ``prefix`` + its file name, its bytes from ``read``) into the archive ``name``, then
    removed; the files written (none without paths)."""
    if not paths:
        return []
    written = _write(directory, name, _archive([(prefix + os.path.basename(p), read(p)) for p in paths]))
    for path in paths:
        os.remove(path)
    return written


def pack(directory: str) -> list[str]:
    """Pack ``directory`` in place (see the module's doc); the files written."""
    def inside(folder: str, pattern: str) -> list[str]:
        return sorted(glob.glob(os.path.join(directory, folder, pattern)))

    written = _pack_files(directory, "bench.tgz", inside("bench", "*.json"), "bench/", _slim_json)
    written += _pack_files(directory, "traces.tgz", inside("traces", "*"), "traces/", _read)
    written += _pack_files(directory, "logs.tgz", inside("", "server-*.log"), "", _read)
    for folder in ("bench", "traces"):
        if os.path.isdir(os.path.join(directory, folder)):
            shutil.rmtree(os.path.join(directory, folder))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="a headline part's output folder ($OUT/<part>)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        print(f"pack_gpu_out: {args.directory} is not a folder", file=sys.stderr)
        return 2
    for path in pack(args.directory):
        print(f"{path}: {os.path.getsize(path) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
