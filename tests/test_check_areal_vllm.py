"""eval/check_areal_vllm.py: the command is AReaL's own for its vLLM server, and the server's
path lets the image's transformers shadow the one in AReaL's site."""
import subprocess
import sys

from eval.check_areal_vllm import SERVER_MODULE, server_command, server_env


def test_the_server_command_is_areals_vllm_server_with_the_checks_sizes():
    cmd = server_command("/ckpt/qwen3", 18731, max_model_len=1024, max_num_seqs=128, gpu_memory_utilization=0.35)
    assert cmd[:3] == ["python3", "-m", SERVER_MODULE]
    flags = dict(zip(cmd[3::1], cmd[4::1]))
    assert flags["--model"] == "/ckpt/qwen3" and flags["--tokenizer"] == "/ckpt/qwen3"
    assert (flags["--port"], flags["--host"]) == ("18731", "127.0.0.1")
    assert (flags["--max-model-len"], flags["--max-num-seqs"]) == ("1024", "128")
    assert flags["--gpu-memory-utilization"] == "0.35" and flags["--tensor-parallel-size"] == "1"
    assert flags["--worker-extension-cls"] == "areal.engine.vllm_ext.vllm_worker_extension.VLLMWorkerExtension"
    assert "--no-enable-prefix-caching" in cmd  # AReaL's default for RL: no stale prefixes


def test_the_server_path_puts_the_images_transformers_before_areals(tmp_path):
    sites = {}
    for name, version in (("vllm_site", None), ("image_site", "5.17.0"), ("areal_site", "5.3.0")):
        site = tmp_path / name
        site.mkdir()
        if version:
            (site / "transformers").mkdir()
            (site / "transformers" / "__init__.py").write_text(f"__version__ = {version!r}\n")
        sites[name] = str(site)
    (tmp_path / "areal_site" / "areal_marker.py").write_text("")
    env = server_env(**sites, base={"PATH": "/usr/bin:/bin"})
    out = subprocess.run([sys.executable, "-c", "import transformers, areal_marker; print(transformers.__version__)"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == "5.17.0"  # the image's, while AReaL's site is still on the path
    assert env["PYTHONPATH"].split(":") == [sites["vllm_site"], sites["image_site"], sites["areal_site"]]
