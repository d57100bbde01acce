"""The CLI: JSON output, the model list, and a clear one-line error (exit 2, no traceback) for each bad input."""

import json
import shutil
import subprocess
import sys

import pytest

from sparsespec.cli import main

from .conftest import tiny_hf_model


def run_main(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_clear_error(code, err, *needles):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparsespec: error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "hi", "--top-p", "1.5"], "top-p"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "positive integer"),
    (["generate", "--prompt", "hi", "--device", "tpu"], "invalid choice"),
    (["generate", "--prompt", "hi", "--dtype", "int3"], "invalid choice"),
    (["generate"], "required"),
    (["generate", "--prompt", "hi", "--model", "no-such-model"], "model not found"),
    (["generate", "--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
    (["frobnicate"], "invalid choice"),
])
def test_invalid_options(capsys, argv, needle):
    assert_clear_error(*run_main(capsys, *argv)[::2], needle)


def test_missing_weight_file(capsys, tiny_folder, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_folder, folder)
    (folder / "model.safetensors").unlink()
    assert_clear_error(*run_main(capsys, "generate", "--model", str(folder), "--prompt", "x")[::2], "no safetensors")


def test_truncated_safetensors(capsys, tiny_folder, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_folder, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    assert_clear_error(*run_main(capsys, "generate", "--model", str(folder), "--prompt", "x")[::2], "truncated")


def test_unsupported_architecture(capsys, tiny_folder, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    assert_clear_error(*run_main(capsys, "generate", "--model", str(folder), "--prompt", "x")[::2],
                       "unsupported architecture", "gpt2")


def test_truncated_gguf(capsys, smollm2_path, tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src:
        bad.write_bytes(src.read(20_000_000))
    assert_clear_error(*run_main(capsys, "generate", "--model", str(bad), "--prompt", "x")[::2], "truncated")


def test_not_a_gguf(capsys, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"\x00" * 1000)
    assert_clear_error(*run_main(capsys, "generate", "--model", str(bad), "--prompt", "x")[::2], "not a GGUF")


@pytest.mark.slow
def test_prompt_longer_than_context(capsys, tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("hello world " * 5000)  # > 8192 tokens
    assert_clear_error(*run_main(capsys, "generate", "--prompt-file", str(prompt))[::2],
                       "exceeds the model's context of 8192")


@pytest.mark.slow
def test_generate_json(capsys):
    code, out, err = run_main(capsys, "generate", "--prompt", "The capital of France is", "--max-new-tokens", "5",
                              "--json")
    assert code == 0, err
    record = json.loads(out)
    assert set(record) == {"token_ids", "text", "prompt_tokens", "ttft_s", "decode_tokens_per_s"}
    assert len(record["token_ids"]) == 5 and record["prompt_tokens"] > 3 and record["ttft_s"] > 0
    assert "Paris" in record["text"]


def test_models_json(capsys):
    code, out, _ = run_main(capsys, "models", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0 and rows["smollm2-135m"]["installed"] and rows["smollm2-135m"]["architecture"] == "llama"
    assert {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"} <= set(rows)


def test_real_process_exit_code_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "sparsespec", "generate", "--prompt", "x", "--top-p", "7"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


def test_non_finite_budget(capsys):
    assert_clear_error(*run_main(capsys, "generate", "--prompt", "x", "--attention", "topk", "--attention-opt",
                                 "budget=inf")[::2], "budget")


def test_non_utf8_prompt_file(capsys, tmp_path):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    assert_clear_error(*run_main(capsys, "generate", "--prompt-file", str(bad))[::2], "not UTF-8")


def test_unwritable_output_folder_is_refused_before_work(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_clear_error(*run_main(capsys, "fidelity", "--out", str(blocker / "sub"))[::2], "cannot write")
    assert_clear_error(*run_main(capsys, "eval", "--out", str(blocker / "sub"), "--samples", "1", "--tasks",
                                 "niah_single", "--lengths", "512")[::2], "cannot write")


def test_fidelity_refuses_dense(capsys):
    assert_clear_error(*run_main(capsys, "fidelity", "--attention", "dense")[::2], "no key selection")


def test_unknown_task_and_bad_length(capsys):
    assert_clear_error(*run_main(capsys, "eval", "--tasks", "nope")[::2], "unknown task")
    assert_clear_error(*run_main(capsys, "eval", "--lengths", "4q")[::2], "invalid length")
