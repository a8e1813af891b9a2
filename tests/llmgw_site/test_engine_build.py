"""scripts/build-llama-server's choice of engine (LLMGW_ENGINE auto/cpu/cuda) and its cmake line,
with a fake nvcc and nvidia-smi on PATH and nothing compiled (LLMGW_BUILD_DRY_RUN=1 prints the
choice); what it keeps, links and leaves alone when a build fails; scripts/gpu-check's clear exit
on a machine without a GPU. And, when this checkout has built the CUDA engine
(scripts/build-cuda-engine), that it loads without a driver and serves on the CPU."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from llmgw import engine
from llmgw.tinygguf import write_tiny_model
from tests.support.engine import free_port
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build-llama-server"
VERSION = re.search(r"^LLAMA_CPP_PYTHON := (\S+)$", (ROOT / "Makefile").read_text(), re.M)[1]  # type: ignore[index]
WHEELS = "cuda-toolkit-13.0.2"


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    return tmp_path / "fake-bin"


def run_script(
    tmp_path: Path,
    fake_bin: Path,
    *,
    engine_choice: str | None,
    python: str = sys.executable,
    dry_run: bool = True,
    link: Path | None = None,
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """The script with PATH = the fake tools, then this PATH without any real nvcc or
    nvidia-smi (this machine has a system nvcc: the tests decide what is found)."""
    fake_bin.mkdir(exist_ok=True)
    kept = [
        entry
        for entry in os.environ.get("PATH", "").split(os.pathsep)
        if entry
        and not (Path(entry) / "nvcc").exists()
        and not (Path(entry) / "nvidia-smi").exists()
    ]
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in {"LLMGW_ENGINE", "CMAKE_CUDA_ARCHITECTURES", "LLMGW_BUILD_DRY_RUN"}
    }
    environment["PATH"] = os.pathsep.join([str(fake_bin), *kept])
    # Never this user's engine cache: a fake engine kept there would be copied by a real setup.
    environment["LLMGW_ENGINE_CACHE"] = str(tmp_path / "engine-cache")
    if engine_choice is not None:
        environment["LLMGW_ENGINE"] = engine_choice
    if dry_run:
        environment["LLMGW_BUILD_DRY_RUN"] = "1"
    environment.update(env)
    argv = [str(SCRIPT), VERSION, str(tmp_path / "venv" / f"llama.cpp-{VERSION}"), python]
    if link is not None:
        argv.append(str(link))
    return subprocess.run(argv, capture_output=True, text=True, env=environment, timeout=60)


def choice(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert result.returncode == 0, result.stderr
    return dict(line.split("=", 1) for line in result.stdout.splitlines())


def fake_gpus(fake_bin: Path, *caps: str) -> None:
    """An nvidia-smi that lists GPUs of these compute capabilities (none: it fails, as it does
    where the driver is missing)."""
    if caps:
        executable(fake_bin / "nvidia-smi", "printf '%s\\n' " + " ".join(caps) + "\n")
    else:
        executable(
            fake_bin / "nvidia-smi",
            "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA "
            "driver.'\nexit 9\n",
        )


def fake_nvcc(fake_bin: Path) -> Path:
    return executable(fake_bin / "nvcc", "echo 'Cuda compilation tools, release 13.0'\n")


# -- the choice -----------------------------------------------------------------------------------


def test_auto_builds_the_cpu_engine_without_nvcc_or_gpu(tmp_path: Path, fake_bin: Path) -> None:
    result = run_script(tmp_path, fake_bin, engine_choice=None)
    found = choice(result)
    assert found["backend"] == "cpu"
    assert found["dest"] == str(tmp_path / "venv" / f"llama.cpp-{VERSION}")
    assert "-DGGML_CUDA" not in found["cmake"]
    assert "-DGGML_NATIVE=OFF" in found["cmake"].split()
    assert result.stderr == ""


def test_auto_keeps_the_cpu_build_where_nvcc_has_no_gpu_to_serve(
    tmp_path: Path, fake_bin: Path
) -> None:
    """CI's case: a toolkit, no GPU (nvidia-smi missing, or failing without a driver)."""
    nvcc = fake_nvcc(fake_bin)
    result = run_script(tmp_path, fake_bin, engine_choice="auto")
    assert choice(result)["backend"] == "cpu"
    assert f"auto: {nvcc} is here but nvidia-smi lists no GPU" in result.stderr
    fake_gpus(fake_bin)
    assert choice(run_script(tmp_path, fake_bin, engine_choice="auto"))["backend"] == "cpu"


def test_auto_without_nvcc_builds_for_cpu_even_with_a_gpu(tmp_path: Path, fake_bin: Path) -> None:
    fake_gpus(fake_bin, "9.0")
    result = run_script(tmp_path, fake_bin, engine_choice="auto")
    assert choice(result)["backend"] == "cpu"
    assert "a GPU but no nvcc on PATH" in result.stderr and "LLMGW_ENGINE=cuda" in result.stderr


def test_auto_builds_cuda_for_the_gpus_present_when_nvcc_is_found(
    tmp_path: Path, fake_bin: Path
) -> None:
    fake_nvcc(fake_bin)
    fake_gpus(fake_bin, "9.0", "8.9", "9.0")
    found = choice(run_script(tmp_path, fake_bin, engine_choice="auto"))
    assert found["backend"] == "cuda"
    assert found["dest"] == str(tmp_path / "venv" / f"llama.cpp-{VERSION}-cuda")
    assert found["cuda_architectures"] == "89;90"
    assert "-DCMAKE_CUDA_ARCHITECTURES=89;90" in found["cmake"].split()


def test_cpu_is_the_cpu_build_whatever_is_here(tmp_path: Path, fake_bin: Path) -> None:
    fake_nvcc(fake_bin)
    fake_gpus(fake_bin, "9.0")
    found = choice(run_script(tmp_path, fake_bin, engine_choice="cpu"))
    assert found["backend"] == "cpu" and "GGML_CUDA" not in found["cmake"]


def test_cuda_without_a_toolkit_follows_the_wheels_recipe(tmp_path: Path, fake_bin: Path) -> None:
    """No nvcc, no GPU: the CUDA 13 wheels and every flag of ENGINE.md's measured recipe, for
    sm_90, beside the CPU build's own flags."""
    found = choice(run_script(tmp_path, fake_bin, engine_choice="cuda"))
    cu13 = tmp_path / "venv" / WHEELS / "nvidia" / "cu13"
    assert found["backend"] == "cuda"
    assert found["cuda_architectures"] == "90"
    assert found["cuda_toolkit"] == f"wheels cuda-toolkit 13.0.2 in {tmp_path / 'venv' / WHEELS}"
    flags = found["cmake"].split()
    for flag in (
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
        "-DGGML_CUDA=ON",
        "-DGGML_CUDA_NO_VMM=ON",
        f"-DCMAKE_CUDA_COMPILER={cu13}/bin/nvcc",
        f"-DCUDAToolkit_ROOT={cu13}",
        "-DCMAKE_CUDA_ARCHITECTURES=90",
        f"-DCMAKE_BUILD_RPATH={cu13}/lib",
    ):
        assert flag in flags, flag


def test_a_system_nvcc_without_cublas_falls_back_to_the_wheels(
    tmp_path: Path, fake_bin: Path
) -> None:
    """This machine's case: /usr/local/cuda-13.0 has nvcc and cudart but no cuBLAS."""
    toolkit = tmp_path / "cuda"
    executable(toolkit / "bin" / "nvcc", "true\n")
    (toolkit / "lib64").mkdir()
    (toolkit / "lib64" / "libcudart.so").touch()
    (fake_bin).mkdir()
    (fake_bin / "nvcc").symlink_to(toolkit / "bin" / "nvcc")
    result = run_script(tmp_path, fake_bin, engine_choice="cuda")
    assert choice(result)["cuda_toolkit"].startswith("wheels cuda-toolkit 13.0.2")
    assert "has no cuBLAS beside it: using the CUDA 13.0.2 toolkit wheels" in result.stderr


def test_a_whole_system_toolkit_is_used_as_it_is(tmp_path: Path, fake_bin: Path) -> None:
    toolkit = tmp_path / "cuda-13.0"
    executable(toolkit / "bin" / "nvcc", "true\n")
    lib = toolkit / "targets" / "x86_64-linux" / "lib"
    lib.mkdir(parents=True)
    for name in ("libcudart.so", "libcublas.so"):
        (lib / name).touch()
    fake_bin.mkdir()
    (fake_bin / "nvcc").symlink_to(toolkit / "bin" / "nvcc")
    found = choice(run_script(tmp_path, fake_bin, engine_choice="cuda"))
    assert found["cuda_toolkit"] == f"system {toolkit}"
    flags = found["cmake"].split()
    assert f"-DCMAKE_CUDA_COMPILER={toolkit}/bin/nvcc" in flags
    assert f"-DCUDAToolkit_ROOT={toolkit}" in flags
    assert f"-DCMAKE_BUILD_RPATH={lib}" in flags
    assert "-DGGML_CUDA_NO_VMM=ON" in flags


def test_cmake_cuda_architectures_wins_and_is_checked(tmp_path: Path, fake_bin: Path) -> None:
    fake_gpus(fake_bin, "9.0")
    found = choice(
        run_script(tmp_path, fake_bin, engine_choice="cuda", CMAKE_CUDA_ARCHITECTURES="86;90")
    )
    assert found["cuda_architectures"] == "86;90"
    bad = run_script(
        tmp_path, fake_bin, engine_choice="cuda", CMAKE_CUDA_ARCHITECTURES="90 -DEVIL=ON"
    )
    assert bad.returncode == 2
    assert "CMAKE_CUDA_ARCHITECTURES must look like '90' or '89;90'" in bad.stderr
    assert bad.stdout == ""


def test_an_unknown_engine_is_refused(tmp_path: Path, fake_bin: Path) -> None:
    result = run_script(tmp_path, fake_bin, engine_choice="rocm")
    assert result.returncode == 2
    assert "LLMGW_ENGINE must be auto, cpu or cuda, not 'rocm'" in result.stderr


# -- kept, linked, left alone -----------------------------------------------------------------------


def fake_engine(folder: Path, built: str) -> Path:
    server = executable(folder / "bin" / "llama-server", "echo 'version: 1 (fake)'\n")
    (folder / ".built").write_text(built)
    return server


def test_a_built_engine_is_kept_and_linked(tmp_path: Path, fake_bin: Path) -> None:
    """A second setup only checks that the engine runs; LINK follows the backend asked for. A CPU
    folder from before backends were recorded counts as a CPU build."""
    base = tmp_path / "venv" / f"llama.cpp-{VERSION}"
    cpu = fake_engine(base, f"llama-cpp-python {VERSION}, built in 240 s\n")
    cuda = fake_engine(
        Path(f"{base}-cuda"), "backend=cuda\ncuda_architectures=90\nbuild_seconds=1230\n"
    )
    link = tmp_path / "venv" / "bin" / "llama-server"
    python = str(executable(tmp_path / "no-python", "echo must not be called; exit 1\n"))
    for asked, expected in (("cuda", cuda), ("cpu", cpu), ("cuda", cuda)):
        result = run_script(
            tmp_path, fake_bin, engine_choice=asked, python=python, dry_run=False, link=link
        )
        assert result.returncode == 0, result.stderr
        assert link.is_symlink() and link.resolve() == expected
        # Relative, so the virtualenv may move.
        assert os.readlink(link) == f"../{expected.parent.parent.name}/bin/llama-server"


def test_auto_keeps_the_cuda_engine_asked_for_before(tmp_path: Path, fake_bin: Path) -> None:
    """`make setup LLMGW_ENGINE=cuda`, then `make run` (auto) on a machine without nvcc: the
    CUDA engine stays linked, built for sm_89 as it was (no GPU here says otherwise); a GPU it
    was built for keeps it too. With the CPU engine linked, auto stays on the CPU."""
    base = tmp_path / "venv" / f"llama.cpp-{VERSION}"
    cpu = fake_engine(base, "backend=cpu\ncuda_architectures=\n")
    cuda = fake_engine(Path(f"{base}-cuda"), "backend=cuda\ncuda_architectures=89;90\n")
    link = tmp_path / "venv" / "bin" / "llama-server"
    link.parent.mkdir(parents=True)
    python = str(executable(tmp_path / "no-python", "echo must not be called; exit 1\n"))

    def auto() -> subprocess.CompletedProcess[str]:
        return run_script(
            tmp_path, fake_bin, engine_choice="auto", python=python, dry_run=False, link=link
        )

    link.symlink_to(cuda)
    assert auto().returncode == 0 and link.resolve() == cuda
    found = choice(run_script(tmp_path, fake_bin, engine_choice="auto", link=link))
    assert (found["backend"], found["dest"]) == ("cuda", f"{base}-cuda")
    assert found["cuda_architectures"] == "89;90"
    fake_gpus(fake_bin, "8.9")
    assert auto().returncode == 0 and link.resolve() == cuda
    link.unlink()
    link.symlink_to(cpu)
    assert auto().returncode == 0 and link.resolve() == cpu


def fake_build_tools(tmp_path: Path, fake_bin: Path) -> Path:
    """A python whose `pip download` leaves a llama-cpp-python sdist with an empty llama.cpp
    tree, and a cmake whose build makes an engine that prints a version: a whole CPU build in a
    second. Returns the python."""
    made = executable(tmp_path / "built-engine", "echo 'version: 1 (fake build)'\n")
    executable(
        fake_bin / "cmake",
        'if [ "$1" = --build ]; then mkdir -p "$2/bin" && touch "$2/bin/libggml-fake.so" && '
        f'cp {made} "$2/bin/llama-server"; fi\n',
    )
    tree = tmp_path / "sdist-tree" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    tree.mkdir(parents=True)
    return executable(
        tmp_path / "python",
        'while [ $# -gt 0 ]; do [ "$1" = -d ] && dir=$2; shift; done\n'
        f'mkdir -p "$dir" && tar -czf "$dir/llama_cpp_python-{VERSION}.tar.gz" '
        f"-C {tmp_path / 'sdist-tree'} llama_cpp_python-{VERSION}\n",
    )


def test_a_cpu_build_is_cached_and_the_next_checkout_copies_it(
    tmp_path: Path, fake_bin: Path
) -> None:
    """A CPU build is kept in the engine cache; a second checkout's setup copies it into its own
    folder (no download, no compiler) and links its own copy, which runs from there."""
    python = fake_build_tools(tmp_path, fake_bin)
    first = tmp_path / "first"
    built = run_script(
        first,
        fake_bin,
        engine_choice="cpu",
        python=str(python),
        dry_run=False,
        LLMGW_ENGINE_CACHE=str(tmp_path / "engine-cache"),
    )
    assert built.returncode == 0, built.stderr
    assert "built in" in built.stdout and "kept in the engine cache" in built.stdout
    cached = tmp_path / "engine-cache" / f"llama.cpp-{VERSION}-cpu"
    assert (cached / "bin" / "llama-server").exists() and (
        cached / "bin" / "libggml-fake.so"
    ).exists()
    assert "backend=cpu" in (cached / ".built").read_text()

    executable(fake_bin / "cmake", "echo must not be called >&2; exit 1\n")
    second = tmp_path / "second"
    link = second / "venv" / "bin" / "llama-server"
    refuse = executable(tmp_path / "no-python", "echo must not be called >&2; exit 1\n")
    copied = run_script(
        second,
        fake_bin,
        engine_choice="cpu",
        python=str(refuse),
        dry_run=False,
        link=link,
        LLMGW_ENGINE_CACHE=str(tmp_path / "engine-cache"),
    )
    assert copied.returncode == 0, copied.stderr
    assert "copied from the engine cache" in copied.stdout
    engine_folder = second / "venv" / f"llama.cpp-{VERSION}"
    assert link.resolve() == engine_folder / "bin" / "llama-server"
    assert not (engine_folder / "bin" / "llama-server").is_symlink()
    assert (engine_folder / ".built").read_text() == (cached / ".built").read_text()
    runs = subprocess.run([str(link)], capture_output=True, text=True, timeout=10)
    assert runs.stdout.strip() == "version: 1 (fake build)"
    assert not list((second / "venv").glob("*.part*"))


def test_a_cache_of_another_version_or_off_builds(tmp_path: Path, fake_bin: Path) -> None:
    """An engine cached for another llama-cpp-python version is not copied; LLMGW_ENGINE_CACHE=off
    neither reads nor writes a cache."""
    python = fake_build_tools(tmp_path, fake_bin)
    other = tmp_path / "engine-cache" / f"llama.cpp-{VERSION}-cpu"
    fake_engine(other, "llama-cpp-python=0.0.1\nbackend=cpu\n")
    result = run_script(
        tmp_path / "a",
        fake_bin,
        engine_choice="cpu",
        python=str(python),
        dry_run=False,
        LLMGW_ENGINE_CACHE=str(tmp_path / "engine-cache"),
    )
    assert result.returncode == 0, result.stderr
    assert "built in" in result.stdout
    assert f"llama-cpp-python={VERSION}" in (other / ".built").read_text()  # replaced
    off = run_script(
        tmp_path / "b",
        fake_bin,
        engine_choice="cpu",
        python=str(python),
        dry_run=False,
        LLMGW_ENGINE_CACHE="off",
    )
    assert off.returncode == 0, off.stderr
    assert "built in" in off.stdout and "engine cache" not in off.stdout
    assert not (tmp_path / "b" / "off").exists()


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_a_failed_build_says_why_and_leaves_the_previous_engine(
    tmp_path: Path, fake_bin: Path
) -> None:
    """A CUDA engine built for another GPU than the one here must be rebuilt; when that fails
    (here: the package index refuses), the message names the step and quotes its log, and the
    old engine and the link stay as they were."""
    fake_gpus(fake_bin, "9.0")
    base = tmp_path / "venv" / f"llama.cpp-{VERSION}"
    old = fake_engine(Path(f"{base}-cuda"), "backend=cuda\ncuda_architectures=80\n")
    cpu = fake_engine(base, "backend=cpu\ncuda_architectures=\n")
    link = tmp_path / "venv" / "bin" / "llama-server"
    link.parent.mkdir(parents=True)
    link.symlink_to(cpu)
    python = executable(
        tmp_path / "python",
        "echo 'ERROR: No matching distribution found for cuda-toolkit==13.0.2' >&2\nexit 1\n",
    )
    result = run_script(
        tmp_path, fake_bin, engine_choice="cuda", python=str(python), dry_run=False, link=link
    )
    assert result.returncode == 1
    assert f"{base}-cuda was built for cuda 80: rebuilding" in result.stderr
    assert (
        "the cuda build failed while installing the CUDA toolkit wheels; "
        "the previous engine (if any) is left in place." in result.stderr
    )
    assert "No matching distribution found for cuda-toolkit==13.0.2" in result.stderr
    assert (old.parent.parent / ".built").read_text() == "backend=cuda\ncuda_architectures=80\n"
    assert link.resolve() == cpu
    assert "No matching distribution" in Path(f"{base}-cuda.failed.log").read_text()


# -- scripts/gpu-check without a GPU ----------------------------------------------------------------


def test_gpu_check_says_there_is_no_gpu_and_exits_2(tmp_path: Path, fake_bin: Path) -> None:
    """Without nvidia-smi, and with one that fails as it does without a driver: exit 2 with the
    reason, before anything is built."""
    path = os.pathsep.join(
        [
            str(fake_bin),
            *(
                p
                for p in os.environ["PATH"].split(os.pathsep)
                if p and not (Path(p) / "nvidia-smi").exists()
            ),
        ]
    )
    fake_bin.mkdir()
    argv = [sys.executable, str(ROOT / "scripts" / "gpu-check")]
    missing = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PATH": path})
    assert missing.returncode == 2
    assert missing.stderr.strip() == (
        "gpu-check: no NVIDIA GPU here: nvidia-smi is not on PATH (no NVIDIA driver installed)"
    )
    fake_gpus(fake_bin)
    failing = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PATH": path})
    assert failing.returncode == 2
    assert failing.stderr.startswith("gpu-check: no NVIDIA GPU here: nvidia-smi failed (exit 9):")
    assert "could not communicate with the NVIDIA driver" in failing.stderr


# -- the CUDA engine, when this checkout has built it -----------------------------------------------


def cuda_engine() -> Path | None:
    """The CUDA llama-server `make setup LLMGW_ENGINE=cuda` built for this checkout or beside
    this Python, if any."""
    for venv in (ROOT / ".venv", Path(sys.executable).parent.parent):
        server = venv / f"llama.cpp-{VERSION}-cuda" / "bin" / "llama-server"
        if server.is_file():
            return server
    return None


CUDA_ENGINE = cuda_engine()
needs_cuda_engine = pytest.mark.skipif(
    CUDA_ENGINE is None, reason="the CUDA engine is not built (scripts/build-cuda-engine)"
)


def clean_env() -> dict[str, str]:
    """No LD_LIBRARY_PATH: the engine must find its CUDA libraries through its own RUNPATH."""
    return {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}


@needs_cuda_engine
def test_the_cuda_engine_loads_without_a_driver() -> None:
    """Built with GGML_CUDA_NO_VMM: nothing needs libcuda.so.1 (the driver) to load, every other
    library is found, and --list-devices answers (a CUDA device, or CUDA's failure to
    initialise where there is no GPU, as here)."""
    assert CUDA_ENGINE is not None
    folder = CUDA_ENGINE.parent
    built = dict(line.split("=", 1) for line in (folder.parent / ".built").read_text().splitlines())
    assert built["backend"] == "cuda"
    for binary in (CUDA_ENGINE, *folder.glob("libggml-cuda.so*")):
        linked = subprocess.run(
            ["ldd", str(binary)], capture_output=True, text=True, env=clean_env(), timeout=30
        ).stdout
        assert "not found" not in linked, linked
        assert "libcuda.so" not in linked, linked
    cuda_lib = subprocess.run(
        ["ldd", str(next(folder.glob("libggml-cuda.so*")))], capture_output=True, text=True
    ).stdout
    assert "libcublas.so.13" in cuda_lib and "libcudart.so.13" in cuda_lib

    version = subprocess.run(
        [str(CUDA_ENGINE), "--version"], capture_output=True, text=True, env=clean_env(), timeout=60
    )
    assert version.returncode == 0, version.stderr
    listing = subprocess.run(
        [str(CUDA_ENGINE), "--list-devices"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
    )
    assert listing.returncode == 0
    said = listing.stdout + listing.stderr
    assert (
        re.search(r"^\s*CUDA0", said, re.M) or "ggml_cuda_init: failed to initialize CUDA" in said
    )


@pytest.fixture
def cpu_served_by_the_cuda_engine(tmp_path: Path) -> Iterator[str]:
    """The tiny model on the CUDA engine with -ngl 0, on 127.0.0.1, stopped by its pid."""
    assert CUDA_ENGINE is not None
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, seed=1)
    settings = engine.EngineSettings(
        model_path=str(model),
        model_alias="tiny-chat",
        host="127.0.0.1",
        port=free_port(),
        context_length=256,
        threads=1,
    )
    log = tmp_path / "engine.log"
    command = [*engine.engine_command(settings, str(CUDA_ENGINE)), "--n-gpu-layers", "0"]
    process = engine.start_engine(command, log)

    def healthy() -> bool:
        assert process.poll() is None, engine.last_output(log)
        return engine.health("127.0.0.1", settings.port, timeout=1) is None

    try:
        wait_for(healthy, timeout=60, what=f"the CUDA engine's /health to answer 200 (log: {log})")
        yield f"http://127.0.0.1:{settings.port}"
    finally:
        engine.stop_process_group(process.pid, child=process, grace=5)


@needs_cuda_engine
@pytest.mark.engine
def test_the_cuda_engine_serves_on_the_cpu_without_a_gpu(
    cpu_served_by_the_cuda_engine: str,
) -> None:
    answer = requests.post(
        f"{cpu_served_by_the_cuda_engine}/v1/chat/completions",
        json={
            "model": "tiny-chat",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
        },
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["usage"]["completion_tokens"] > 0
    assert isinstance(body["choices"][0]["message"]["content"], str)
