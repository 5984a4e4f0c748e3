"""The llama.cpp peer of the offline benchmark (``cb_serve.benchmarks.llama_cpp``): its pure pieces only
(build key, vendored commit, command lines, request bodies, response parsing, agreement counting); a
real build takes minutes and serving needs that build, so neither runs here."""

from __future__ import annotations

import pytest

from cb_serve.benchmarks import llama_cpp
from cb_serve.benchmarks.llama_cpp import (
    completion_body,
    parse_completion,
    server_command,
    slot_context,
    vendored_commit,
)
from cb_serve.benchmarks.report import SystemResult, batch_invariance, cb_serve_ratios
from cb_serve.benchmarks.workload import Workload

CHANGELOG = """# Changelog

## [Unreleased]

## [0.3.36]

- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098

## [0.3.35]

- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f
- feat: update llama.cpp to ggml-org/llama.cpp@adb55e514
"""


def test_vendored_commit_is_read_from_the_version_section():
    assert vendored_commit(CHANGELOG, "0.3.36") == "0c1e57098"
    assert vendored_commit(CHANGELOG, "0.3.35") == "4df29be4f"  # the newest update of that release
    assert vendored_commit(CHANGELOG, "0.3.1") == "unknown"


def test_build_key_changes_with_the_cpu_and_the_options():
    key = llama_cpp.build_key("0.3.36", {"avx2", "avx512f"}, ["-DA=1"])
    assert key.startswith("0.3.36-") and key == llama_cpp.build_key("0.3.36", {"avx512f", "avx2"}, ["-DA=1"])
    assert key != llama_cpp.build_key("0.3.36", {"avx2"}, ["-DA=1"])
    assert key != llama_cpp.build_key("0.3.36", {"avx2", "avx512f"}, ["-DA=0"])


def test_cmake_builds_only_the_server_natively(tmp_path):
    options = llama_cpp.cmake_options(tmp_path, {"avx512f"})
    assert options == llama_cpp.CMAKE_OPTIONS
    configure, build = llama_cpp.cmake_commands(tmp_path / "src", tmp_path / "build", options, "abc1234", 2)
    assert "-DGGML_NATIVE=ON" in configure and "-DLLAMA_BUILD_COMMIT=abc1234" in configure
    assert build[build.index("--target") + 1] == "llama-server" and build[-1] == "2"


def test_amx_cpus_get_the_tile_config_fix(tmp_path):
    options = llama_cpp.cmake_options(tmp_path, {"avx512f", "amx_tile"})
    assert options[-1] == f"-DCMAKE_CXX_FLAGS=-include {tmp_path / llama_cpp.TILECFG_HEADER}"
    assert "ldtilecfg" in llama_cpp.TILECFG_FIX and "[64]" in llama_cpp.TILECFG_FIX  # the whole 64-byte config


def test_vendored_source_is_the_tree_the_build_came_from(tmp_path):
    directory = tmp_path / "0.3.36-abc"
    build = llama_cpp.LlamaServerBuild(
        str(directory / "build" / "bin" / "llama-server"), "0.3.36", "0c1e57098", (), "", 0
    )
    with pytest.raises(llama_cpp.LlamaCppUnavailable, match="convert_hf_to_gguf"):
        llama_cpp.vendored_source(build)
    source = directory / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    source.mkdir(parents=True)
    (source / "convert_hf_to_gguf.py").write_text("")
    assert llama_cpp.vendored_source(build) == source


def test_missing_tools_make_it_unavailable(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda tool: None)
    with pytest.raises(llama_cpp.LlamaCppUnavailable, match="cmake"):
        llama_cpp.ensure_llama_server(cache_root=tmp_path)


def workload(prompt_lens: list[int], output_lens: list[int]) -> Workload:
    return Workload([[1] * n for n in prompt_lens], output_lens, 1000, "test")


def test_slot_context_fits_the_longest_request():
    assert slot_context(workload([32, 500], [256, 200])) == 768  # 700 + 1, rounded up to 256
    assert slot_context(workload([255], [0])) == 256


def test_server_command_serves_slots_sharing_the_context():
    cmd = server_command("/bin/llama-server", "/m.gguf", 8123, 16, 12288, 2)
    assert cmd[0] == "/bin/llama-server"
    args = {flag: cmd[cmd.index(flag) + 1] for flag in ("-m", "--host", "--port", "-np", "-c", "-t", "-tb")}
    assert args["-m"] == "/m.gguf" and args["--host"] == "127.0.0.1" and args["--port"] == "8123"
    assert (args["-np"], args["-c"], args["-t"], args["-tb"]) == ("16", "12288", "2", "2")
    assert "--cont-batching" in cmd


def test_completion_body_is_greedy_token_ids_without_eos_or_prompt_cache():
    body = completion_body((3, 4, 5), 7)
    assert body["prompt"] == [3, 4, 5] and body["n_predict"] == 7
    assert body["temperature"] == 0 and body["top_k"] == 1
    assert body["ignore_eos"] and body["return_tokens"] and not body["cache_prompt"] and not body["stream"]


def test_parse_completion_demands_exactly_the_requested_tokens():
    assert parse_completion({"tokens": [1, 2, 3], "tokens_predicted": 3}, 3) == [1, 2, 3]
    with pytest.raises(RuntimeError, match="2 tokens"):
        parse_completion({"tokens": [1, 2], "tokens_predicted": 2, "stop_type": "eos"}, 3)
    with pytest.raises(RuntimeError, match="no token ids"):
        parse_completion({"content": "text"}, 3)


def result(name: str, wall_s: float, outputs: list[list[int]]) -> SystemResult:
    generated = sum(len(o) for o in outputs)
    return SystemResult(name, wall_s, generated, generated, outputs)


def test_agreement_and_ratio_with_llama_cpp():
    hf = result("hf-static", 4.0, [[1, 2], [3, 4], [5, 6]])
    cb = result("cb-serve", 1.0, [[1, 2], [3, 4], [5, 6]])
    llama = result("llama.cpp", 2.0, [[1, 2], [3, 9], [5, 6]])
    ratios = cb_serve_ratios({"cb-serve": cb, "hf-static": hf, "llama.cpp": llama}, workload_roofline=100.0)
    assert ratios["cb_serve_over_llama_cpp"] == pytest.approx(2.0)
    assert ratios["cb_serve_over_hf_static"] == pytest.approx(4.0)
    assert llama.extra["agreement_with_hf_static_identical_requests"] == pytest.approx(2 / 3)
    assert llama.extra["agreement_with_cb_serve_identical_requests"] == pytest.approx(2 / 3)
    assert cb.extra["agreement_with_hf_static_identical_requests"] == 1.0


def test_batch_invariance_counts_identical_requests():
    batched = [[1, 2], [3, 4], [5, 6]]
    assert batch_invariance(batched[:2], [[1, 2], [3, 5]]) == {"requests": 2, "identical": 1}
