"""scripts/pack_gpu_out.py: a headline part's folder packed into few files that a device call brings back."""

import importlib.util
import io
import json
import os
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("pack_gpu_out", os.path.join(HERE, "..", "scripts", "pack_gpu_out.py"))
pack_gpu_out = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pack_gpu_out)


def _part(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "traces").mkdir()
    result = {"output_throughput": 1.5, "itls": [[0.0123456789, 0.0071234567]], "generated_texts": ["x" * 1000]}
    (tmp_path / "bench" / "separate-no-sd-c1024.json").write_text(json.dumps(result))
    (tmp_path / "traces" / "trace-separate-no-sd.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "server-no-sd-separate.log").write_text("listening\n")
    (tmp_path / "headline_h200.json").write_text("{}")
    return tmp_path


def _members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_a_part_packs_into_three_archives_beside_its_result(tmp_path):
    part = _part(tmp_path)
    written = pack_gpu_out.pack(str(part))
    assert sorted(os.path.basename(p) for p in written) == ["bench.tgz", "logs.tgz", "traces.tgz"]
    assert sorted(os.listdir(part)) == ["bench.tgz", "headline_h200.json", "logs.tgz", "traces.tgz"]
    bench = json.loads(_members((part / "bench.tgz").read_bytes())["bench/separate-no-sd-c1024.json"])
    assert bench == {"output_throughput": 1.5, "itls": [[0.012346, 0.007123]]}  # no texts; latencies to 1 us
    assert _members((part / "traces.tgz").read_bytes()) == {"traces/trace-separate-no-sd.jsonl": b'{"step": 1}\n'}
    assert _members((part / "logs.tgz").read_bytes()) == {"server-no-sd-separate.log": b"listening\n"}


def test_an_archive_over_the_limit_is_cut_into_pieces_that_join_back(tmp_path, monkeypatch):
    monkeypatch.setattr(pack_gpu_out, "PIECE_BYTES", 64)
    part = _part(tmp_path)
    pack_gpu_out.pack(str(part))
    pieces = sorted(p for p in os.listdir(part) if p.startswith("bench.tgz."))
    assert len(pieces) > 1 and all(os.path.getsize(part / p) <= 64 for p in pieces)
    joined = b"".join((part / p).read_bytes() for p in pieces)
    assert "bench/separate-no-sd-c1024.json" in _members(joined)


def test_a_missing_folder_is_one_line(tmp_path, capsys):
    assert pack_gpu_out.main([str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err
