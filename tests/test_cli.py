"""The ``twogrid plan`` command as a user runs it."""

import json
import os
import subprocess
import sys

import pytest

from dispatcher.cli import main
from dispatcher.configure import compact_sizes

SM100 = ["--platform", "sm100", "--max-num-seqs", "1024", "--max-num-batched-tokens", "16384"]


def run(*args):
    proc = subprocess.run([sys.executable, "-m", "dispatcher", *args], capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("spec, drafter, q, total", [
    ('{"method": "eagle3", "num_speculative_tokens": 7}', "eagle3", "8", 238),
    ('{"method": "draft_model", "model": "tiny-dense", "num_speculative_tokens": 3}', "draft_model", "4", 270),
], ids=["eagle3", "draft_model"])
def test_plan_table(capsys, spec, drafter, q, total):
    assert main(["plan", *SM100, "--speculative-config", spec]) == 0
    out = capsys.readouterr().out
    lines = {tuple(line.split()[:6]) for line in out.splitlines()}
    reach = {"8": ("48", "512"), "4": ("64", "1024")}[q]
    for runner in ("target", drafter):
        assert (runner, "piecewise", "tokens", "-", "39", "8192") in lines
        assert (runner, "full_decode", "requests", q, *reach) in lines
    assert (f"{drafter}_next_steps", "full_decode", "requests", "1", "64", "1024") in lines
    assert f"total: {total} graphs" in out


def test_plan_json_is_the_spec_schema():
    rc, out, _ = run("plan", *SM100, "--json")
    assert rc == 0
    plan = json.loads(out)
    assert plan["platform"] == "sm100"
    assert plan["runners"] == [
        {"runner": "target", "kind": "piecewise", "unit": "tokens", "q": None, "sizes": plan["runners"][0]["sizes"]},
        {"runner": "target", "kind": "full_decode", "unit": "requests", "q": 1, "sizes": plan["runners"][1]["sizes"]},
    ]
    assert len(plan["runners"][0]["sizes"]) == 39 and len(plan["runners"][1]["sizes"]) == 64


def test_bad_config_exits_2_with_the_message():
    rc, out, err = run("plan", "--compilation-config", '{"max_cudagraph_capture_size": 1024, '
                       '"decode_cudagraph_capture_request_sizes": [1, 2]}')
    assert rc == 2 and out == ""
    assert err.strip() == ("twogrid plan: error: deprecated field max_cudagraph_capture_size cannot be mixed with "
                           "decode_cudagraph_capture_request_sizes: set the prefill/decode fields alone (or only the "
                           "deprecated ones)")
    rc, _, err = run("plan", "--compilation-config", "{not json")
    assert rc == 2 and "--compilation-config: invalid JSON" in err


def test_warnings_are_shown(capsys):
    main(["plan", "--platform", "sm100", "--max-num-batched-tokens", "4096",
          "--compilation-config", '{"prefill_cudagraph_capture_token_sizes": [1, 8192]}'])
    out = capsys.readouterr().out
    assert ("warning: prefill_cudagraph_capture_token_sizes: dropped 1 size(s) above max_num_batched_tokens = 4096"
            in out)


def test_diff_of_two_configs(tmp_path, capsys):
    a, b = tmp_path / "main.json", tmp_path / "new.json"
    spec = {"method": "eagle3", "num_speculative_tokens": 7}
    a.write_text(json.dumps({"platform": "sm100", "compilation_config": {"max_cudagraph_capture_size": 1024},
                             "speculative_config": spec}))
    b.write_text(json.dumps({"platform": "sm100", "speculative_config": spec}))
    assert main(["plan", "--diff", str(a), str(b), "--json"]) == 0
    diffs = {(d["runner"], d["kind"], d["q"]): d for d in json.loads(capsys.readouterr().out)}
    target = diffs[("target", "full_decode", 8)]
    assert (target["graphs_before"], target["graphs_after"], target["status"]) == (80, 48, "gains coverage")
    assert diffs[("target", "piecewise", None)]["covered_before"] == 1024


def test_diff_of_a_saved_plan_against_itself(tmp_path, capsys):
    main(["plan", *SM100, "--json"])
    saved = tmp_path / "plan.json"
    saved.write_text(capsys.readouterr().out)
    main(["plan", "--diff", str(saved), str(saved)])
    out = capsys.readouterr().out
    assert out.count("identical") == 2


def test_diff_names_a_bad_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"compilation_config": {}, "max_num_seq": 3}')
    rc, _, err = run("plan", "--diff", str(bad), str(bad))
    assert rc == 2 and "unknown key 'max_num_seq'" in err
    for runners, words in [('"x"', "'runners' must be a list of graph sets, got str"),  # (tracebacks before)
                           ('[{"runner": "target"}]', "runners[0] must be a graph set {runner, kind, q, sizes}")]:
        bad.write_text('{"runners": ' + runners + "}")
        rc, _, err = run("plan", "--diff", str(bad), str(bad))
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_matrix_refuses_an_unknown_method():
    """--methods eagle3,bogus swept, reported 1512 configs "rejected by validation" and exited 0 (the CLI probe)."""
    for methods in ("eagle3,bogus", ""):
        rc, _, err = run("plan", "--matrix", "--methods", methods)
        assert rc == 2 and f"--methods: {methods.split(',')[-1]!r} is not a speculative method" in err, err


@pytest.mark.parametrize("args, line", [
    (["--methods", "eagle3"], "--methods is for --matrix"),  # (each was ignored at exit 0: the CLI probe)
    (["--pretty"], "--pretty is for --json"),
    (["--matrix", "--diff", "a.json", "b.json"], "--matrix and --diff are two of plan's modes: give one"),
])
def test_plan_refuses_flags_it_would_ignore(args, line):
    rc, _, err = run("plan", *args)
    assert rc == 2 and err.strip() == f"twogrid plan: error: {line}", err


def test_matrix_sweeps_the_issue_grid(capsys):
    assert main(["plan", "--matrix", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["configs"] == 1680 and result["invalid_configs"] == 0
    rows = {(r["runner"], r["kind"]): r for r in result["summary"]}
    assert rows[("target", "piecewise")]["loses coverage"] == 0
    assert rows[("target", "full_decode")]["loses coverage"] == 0
    assert rows[("target", "full_decode")]["graph_delta"] < 0
    assert result["seconds"] < 10
    assert main(["plan", "--matrix", "--json", "--methods", "draft_model"]) == 0  # (its "model" filled in)
    result = json.loads(capsys.readouterr().out)
    assert result["configs"] == 1680 and result["invalid_configs"] == 0
    rows = {(r["runner"], r["kind"]): r for r in result["summary"]}
    assert rows[("drafter_next_steps", "full_decode")]["sets"] and not any(r["loses coverage"] for r in rows.values())


def test_plan_does_not_import_torch():
    code = ("import sys; from dispatcher.cli import main; main(['plan', '--platform', 'sm100', '--matrix']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`twogrid plan | head -1`: the pipe closes before the table is written; the command ends quietly (exit 141,
    as a shell reports SIGPIPE) instead of printing a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "dispatcher", "plan", *SM100], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err, err


@pytest.mark.parametrize("sizes,text", [
    ((1, 2, 3, 4, 5, 6, 8, 10, 12), "1..6, 8..12/2"),
    ((1, 2, 4, 8), "1, 2, 4, 8"),
    ((), ""),
    ((256, 512, 768, 1024, 8192), "256..1024/256, 8192"),
])
def test_compact_sizes(sizes, text):
    assert compact_sizes(sizes) == text


def test_platform_auto_gives_hopper_and_blackwell_the_separate_grids_defaults():
    from dispatcher.configure import platform_for_compute_capability
    from dispatcher.plan.config import Platform

    assert platform_for_compute_capability("9.0") is Platform.SM100  # H100 / H200: measured, docs/headline.md
    assert platform_for_compute_capability("10.0") is Platform.SM100
    assert platform_for_compute_capability("8.9") is Platform.DEFAULT
    assert platform_for_compute_capability("8.0") is Platform.DEFAULT
    assert platform_for_compute_capability("") is Platform.DEFAULT  # no GPU, or no nvidia-smi


@pytest.mark.parametrize("count", ["0", "65"])
def test_serve_refuses_an_api_server_count_out_of_range(count):
    """Before anything starts: one line naming the flag and its range, exit code 2."""
    rc, out, err = run("serve", "--api-server-count", count, "--device", "cpu")
    assert rc == 2 and out == ""
    assert err.strip() == f"twogrid serve: error: --api-server-count must be in 1..64, got {count}"


@pytest.mark.parametrize("args, line", [
    (["--port", "70000"], "--port must be in 1..65535, got 70000"),
    (["--port", "0"], "--port must be in 1..65535, got 0"),
    (["--step-trace", "/no/such/dir/t.jsonl"], "--step-trace: the directory '/no/such/dir' does not exist"),
    (["--allowed-origins", "*"], "--allowed-origins must be a JSON list of strings"),
    (["--allowed-headers", '["x", 1]'], "--allowed-headers must be a JSON list of strings"),
    (["--host", "203.0.113.7"], "--host: cannot listen on '203.0.113.7': cannot assign requested address"),
    (["--host", "no-such-host.invalid"], "--host: cannot listen on 'no-such-host.invalid': "),
    (["--stream-interval", "0"], "--stream-interval must be a token count >= 1, got 0"),
    (["--admission-wait-steps", "-2"], "--admission-wait-steps must be a step count >= 0, got -2"),
    (["--max-model-len", "0"], "--max-model-len must be in 1.."),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a number of seconds >= 0, got -1"),
    (["--step-trace", "/tmp"], "--step-trace: '/tmp' is a directory"),
    (["--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent/d"}'],
     "--speculative-config model: model '/nonexistent/d': no such directory"),  # (it said --model)
    (["--tokenizer", "/nonexistent/tok.gguf"], "--tokenizer must be a Hugging Face checkpoint directory or a .gguf "
     "file: '/nonexistent/tok.gguf' is no such directory or file"),  # (a traceback once the model loaded; then
    # "--tokenizer: model '/nonexistent/tok.gguf': ... --model takes ...")
    (["--tokenizer", "tiny-dense"], "--tokenizer must be a Hugging Face checkpoint directory or a .gguf file: "
     "'tiny-dense' is a preset (random weights, no tokenizer)"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--fixed-acceptance", "10"],
     "--fixed-acceptance must be a mean acceptance length in [1, 1 + K] = [1, 4], got 10"),  # (likewise)
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be a number of seconds >= 0, got nan"),
    (["--block-size", "100000000000"], "--block-size must be in 1..1024, got 100000000000"),  # (an allocation
    # error in the worker)
    (["--seed", "-1"], "--seed must be in 0..9223372036854775807, got -1"),  # (a traceback in the engine, after
    # the model loaded)
    (["--seed", str(2**70)], f"--seed must be in 0..9223372036854775807, got {2**70}"),  # (a traceback: msgpack)
])
def test_serve_refuses_bad_flags_before_loading_the_model(args, line):
    """One line naming the flag, exit code 2, before any model is read (a preset here: nothing would be slow)."""
    rc, out, err = run("serve", "--model", "tiny-dense", "--device", "cpu", *args)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.strip().startswith(f"twogrid serve: error: {line}"), err


@pytest.mark.parametrize("command", [["generate", "--model", "tiny-dense", "--device", "cpu"],
                                     ["simulate", "--platform", "default"]], ids=["generate", "simulate"])
@pytest.mark.parametrize("seed", ["-1", str(2**63)])
def test_a_seed_out_of_range_is_one_line_naming_the_flag(command, seed):
    """generate said "error: expected non-negative integer" (no flag) for -1 and "Overflow when unpacking long long"
    for a seed past 64 bits; every subcommand's --seed is 0..2^63 - 1 (a request's own seed is vLLM's signed 64-bit
    one), checked as the flags are read."""
    rc, out, err = run(*command, "--seed", seed, *(["1", "2"] if command[0] == "generate" else []))
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.strip() == f"twogrid {command[0]}: error: --seed must be in 0..{2**63 - 1}, got {seed}", err


@pytest.mark.parametrize("device", ["bogus", "CPU", "meta"])
def test_generate_refuses_a_device_it_cannot_run_on_in_one_line(device):
    """It was torch's RuntimeError under a traceback ("Expected one of cpu, cuda, ... device string")."""
    rc, out, err = run("generate", "--model", "tiny-dense", "--device", device, "1", "2")
    assert rc == 2 and out == ""
    assert err.strip() == f"twogrid generate: error: --device must be cpu, cuda or cuda:N, got {device!r}", err


def test_a_draft_head_is_checked_before_anything_starts_and_its_weights_by_the_worker(tmp_path):
    """A head's config.json is read against the target's before anything starts: a head that is not there, or one
    made for another model, is one line with exit code 2 (the worker found them after the model loaded). Its
    tensors are the worker's to read: a head without weights fails the worker's start-up with one line naming it,
    not under a traceback (the CLI probe saw a multi-frame trace)."""
    spec = lambda path: ["--speculative-config", json.dumps(  # noqa: E731
        {"method": "eagle3", "num_speculative_tokens": 3, "model": str(path)})]
    base = ["serve", "--model", "tiny-dense", "--device", "cpu"]
    rc, _, err = run(*base, *spec("/nonexistent/head"))
    assert rc == 2 and err.strip() == ("twogrid serve: error: --speculative-config model '/nonexistent/head': no "
                                       "config.json (a draft head is a directory with config.json and "
                                       "*.safetensors)"), err
    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "heads",
                           "smollm2-135m-instruct-eagle3")
    rc, _, err = run(*base, *spec(shipped))
    assert rc == 2 and f"draft head {shipped!r}: vocab_size = 49152, the target's is 512" in err, err
    (tmp_path / "config.json").write_text(json.dumps({  # (tiny-dense's shape, no weights beside it)
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "rope_theta": 10000.0,
        "vocab_size": 512, "max_position_embeddings": 2048}))
    rc, _, err = run(*base, *spec(tmp_path))
    assert rc != 0 and "Traceback" not in err, err
    assert f"worker start-up failed: DraftHeadError: {tmp_path}: no *.safetensors with the draft head's weights" in err


def test_serve_refuses_a_model_whose_own_chat_template_does_not_parse(tiny_llama, tmp_path):
    """Every chat request would get a 400: refused at start, as a broken --chat-template is, naming the way out."""
    import shutil

    shutil.copytree(tiny_llama, tmp_path / "m")
    cfg_path = tmp_path / "m" / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "chat_template": "{% for m in messages %}"}))
    rc, _, err = run("serve", "--model", str(tmp_path / "m"), "--device", "cpu")
    assert rc == 2 and err.strip().startswith("twogrid serve: error: --model: chat template does not parse"), err
    assert "give a working one with --chat-template" in err


def test_serve_refuses_a_checkpoint_whose_shards_disagree_before_anything_starts(tiny_llama, tmp_path):
    """A tensor in two shards (which copy loads was an accident of file order): one line, exit code 2, from the
    shards' headers before the model loads."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_llama, tmp_path / "m")
    norm = {"model.norm.weight": load_file(str(next((tmp_path / "m").glob("*.safetensors"))))["model.norm.weight"]}
    save_file(norm, str(tmp_path / "m" / "zz-stale.safetensors"))
    rc, _, err = run("serve", "--model", str(tmp_path / "m"), "--device", "cpu")
    assert rc == 2 and err.strip().startswith("twogrid serve: error: --model: ") and "'model.norm.weight' is in both" \
        in err, err


def test_serve_refuses_a_port_in_use_before_anything_starts():
    """Another server on the port: one line naming --host/--port, exit code 2, from the first checks (no engine
    process is started for nothing)."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        rc, out, err = run("serve", "--model", "tiny-dense", "--device", "cpu", "--port", str(port))
    assert rc == 2 and out == "" and err.strip() == (
        f"twogrid serve: error: --host/--port: cannot listen on 127.0.0.1:{port}: address already in use (another "
        f"server there? give another --port)")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_device_cuda_without_a_gpu_is_one_line(command):
    rc, out, err = run(command, "--model", "tiny-dense", "--device", "cuda", *(["1 2 3"] if command == "generate"
                                                                            else []))
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert err.strip().startswith(f"twogrid {command}: error: --device cuda: no CUDA GPU is visible"), err


def test_generate_temperature_is_the_servers_range():
    rc, out, err = run("generate", "--model", "tiny-dense", "--device", "cpu", "--temperature", "5", "1 2 3")
    assert rc == 2 and err.strip() == "twogrid generate: error: temperature must be in [0, 2], got 5.0"


def test_generate_on_a_preset_asks_for_token_ids_by_name():
    """A text prompt for a model without a tokenizer said "invalid literal for int() with base 10" (the CLI probe)."""
    rc, out, err = run("generate", "--model", "tiny-dense", "--device", "cpu", "--max-tokens", "2", "Hello world")
    assert rc == 2 and err.strip() == ("twogrid generate: error: 'tiny-dense' has no tokenizer: give each prompt as "
                                       "token ids separated by spaces (such as '5 6 7'), got 'Hello world'")


def test_cli_llm_and_serve_share_their_pieces_without_an_import_circle():
    """detect_platform, config_from_args, render_plan and generation_defaults live in dispatcher.configure, which
    imports none of cli, llm and serve.launch; the command line imports the other two (its subcommands), they
    import neither it nor each other."""
    import ast
    import pathlib

    def imports(path: str) -> set[str]:
        tree = ast.parse(pathlib.Path(path).read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    three = {"dispatcher.cli", "dispatcher.llm", "dispatcher.serve.launch"}
    assert not imports("dispatcher/configure.py") & three
    assert "dispatcher.cli" not in imports("dispatcher/llm.py") | imports("dispatcher/serve/launch.py")
    assert "dispatcher.llm" not in imports("dispatcher/serve/launch.py")
    assert "dispatcher.serve.launch" not in imports("dispatcher/llm.py")
@pytest.mark.parametrize("args, message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)"),
    (["--structured-outputs-config", '{"backend": "outlines"}'], "--structured-outputs-config: backend 'outlines' is "
                                                                  "not available (xgrammar)"),
    (["--structured-outputs-config", '{"compile_timeout_s": -1}'], "compile_timeout_s must be in (0, 3600]"),
    (["--structured-outputs-config", '{"cache": 1}'], "unknown key(s) cache"),
    (["--chat-template", "no/such/file"], "--chat-template: 'no/such/file' is neither a file nor a Jinja template"),
    (["--chat-template", "{% if %}"], "--chat-template: chat template does not parse"),
], ids=["auto without a parser", "other backend", "bad timeout", "unknown key", "no template",
        "broken template"])
def test_serve_refuses_bad_structured_output_and_tool_flags(args, message):
    """Before the model loads: one line naming the flag, exit code 2."""
    rc, out, err = run("serve", "--device", "cpu", *args)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, err
