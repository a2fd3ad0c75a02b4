import json
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

from gradspec.cli import main
from gradspec.linalg import extension


def test_env_says_what_this_machine_has(capsys):
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cpp_extension"]["built"] == extension.BUILT
    assert info["versions"]["torch"] == torch.__version__ and info["versions"]["gradspec"]
    assert info["threads"]["torch_intra_op"] == torch.get_num_threads()
    assert len(info["cuda"]["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert f"threads.torch_intra_op: {torch.get_num_threads()}" in text and "cpp_extension.built: " in text


def test_env_lists_cuda_devices_with_their_compute_capability(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=141 * 2**30))
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert "cuda.devices.0.name: NVIDIA H200" in text and "cuda.devices.0.compute_capability: 9.0" in text
    assert "cuda.devices.0.memory_gib: 141.0" in text


def test_env_names_the_cpu_model_and_its_vector_units(tmp_path):
    from gradspec.runs.numerics import cpu

    info = tmp_path / "cpuinfo"
    core = "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu sse avx512f amx_tile\n"
    info.write_text(f"processor\t: 0\n{core}\nprocessor\t: 1\n{core}")
    assert cpu(str(info)) == {"model": "Intel(R) Xeon(R) Processor", "avx512": True, "amx": True}
    info.write_text("model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2\n")
    assert cpu(str(info)) == {"model": "AMD EPYC 7B13", "avx512": False, "amx": False}


def test_env_finds_cupy_by_any_cuda_major_versions_wheel(monkeypatch, capsys):
    """CuPy's wheel is named by CUDA major version: the H200's image has cupy-cuda13x."""
    import importlib

    module = importlib.import_module("gradspec.environment")  # the package exports its function by that name
    found = {"cupy-cuda13x": "14.2.0"}
    monkeypatch.setattr(module, "_version", lambda package: found.get(package))
    assert module.environment()["cupy"] == "14.2.0"
    assert module.environment()["versions"] == found


def _thread_policy(env: dict[str, str], code: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          check=True)
    return done.stdout.strip()


def test_the_gradspec_command_s_thread_pools_sleep_when_idle_unless_the_user_said_otherwise():
    """The console entry sets OpenMP's wait policy passive and OpenBLAS to one thread before torch and NumPy
    load (spinning pools made a shared machine 100x slower: benchmarks/throughput/bench_contention.py); a value the
    user set is kept, and a program that imported torch first is left as it is."""
    show = ("import os\nfrom gradspec.cli import polite_threads\n{before}polite_threads()\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('OPENBLAS_NUM_THREADS'))")
    assert _thread_policy({}, show.format(before="")) == "PASSIVE 1"
    assert _thread_policy({"OMP_WAIT_POLICY": "ACTIVE"}, show.format(before="")) == "ACTIVE 1"
    assert _thread_policy({}, show.format(before="import torch\n")) == "None None"
