"""The Docker image without a Docker daemon: the paths its user writes (read from the Dockerfile and
docker-compose.yml, then the Dockerfile's user step run in a folder here and every path written as
that user), each party's migration before its containers start, and its Python environment: the
Dockerfile's own install step run into a clean venv (a real install of the CPU image; a resolution,
`pip install --dry-run`, of the CUDA images, whose toolkit wheels are gigabytes), and where a GPU
is present a real install of the CUDA image's set whose NVRTC compiles a kernel. The installs need
PyPI (pip's cache helps)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import venv
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.morphoweb.test_security_compose import compose, in_profile

DOCKERFILE = REPO / "Dockerfile"
# Installs from PyPI: minutes on a cold cache, more than the suite's 600 s default allows.
pytestmark = pytest.mark.timeout(3600)


def install_step() -> str:
    """The Dockerfile's RUN instruction that installs the requirements, continuations joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    steps = [line[4:] for line in text.splitlines()
             if line.startswith("RUN ") and "pip install" in line]
    assert len(steps) == 1, steps
    return steps[0]


def requirement(extras: str) -> str:
    """The requirement string of the install step for build arg MORPHO_EXTRAS=extras, expanded by
    sh as Docker's RUN expands it."""
    match = re.search(r'pip install --no-cache-dir \./pir ("[^"]+")', install_step())
    assert match, install_step()
    done = subprocess.run(["sh", "-c", f"printf %s {match.group(1)}"], capture_output=True,
                          text=True, check=True, env={"MORPHO_EXTRAS": extras})
    return done.stdout


def build_context(root: Path) -> Path:
    """What the image has when the install step runs: `COPY pyproject.toml README.md ./` and the
    protocol core, `COPY pir pir`."""
    assert "\nCOPY pyproject.toml README.md ./\nCOPY pir pir\n" in DOCKERFILE.read_text()
    context = root / "app"
    context.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, context / name)
    shutil.copytree(REPO / "pir", context / "pir",
                    ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    return context


def make_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin"


def pip_env(bin_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(bin_dir.parent)
    return env


def test_the_build_arg_follows_compose_semantics():
    # ${MORPHO_IMAGE_EXTRAS-cuda13}: unset gives cuda13, set to empty gives a CPU-only image.
    base = {"POSTGRES_PASSWORD": "x", "PARTY_A_SECRET_KEY": "x", "PARTY_B_SECRET_KEY": "x"}
    for env, extras in (({}, "cuda13"), ({"MORPHO_IMAGE_EXTRAS": ""}, ""),
                        ({"MORPHO_IMAGE_EXTRAS": "cuda12"}, "cuda12")):
        config = compose({**base, **env})
        built = {name: svc["build"]["args"]["MORPHO_EXTRAS"]
                 for name, svc in config["services"].items() if "build" in svc}
        assert built and set(built.values()) == {extras}, built
    assert requirement("") == "."
    assert requirement("cuda13") == ".[cuda13]"


# --- the image's user and every path it writes ------------------------------------------------
def image_user() -> tuple[str, int]:
    """(name, uid) of the user the image runs as."""
    text = DOCKERFILE.read_text()
    user = re.findall(r"^USER (\S+)$", text, re.MULTILINE)[-1]
    uid = re.search(rf"useradd [^&]*--uid (\d+) {user}\b", text.replace("\\\n", " "))
    assert uid, f"no useradd of {user} with a --uid"
    return user, int(uid.group(1))


def user_step() -> list[str]:
    """The commands of the RUN instruction that makes the image's user, continuations joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    steps = [line[4:] for line in text.splitlines() if line.startswith("RUN ") and "useradd" in line]
    assert len(steps) == 1, steps
    return [command.strip() for command in steps[0].split("&&")]


def image_env() -> dict:
    """The Dockerfile's ENV values (`ENV A=1 \\ B=2`)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return dict(pair.split("=", 1) for line in text.splitlines() if line.startswith("ENV ")
                for pair in line[4:].split())


def image_services(profile: str) -> dict:
    """The services of `profile` that run the image as its own user (the one-shot `matrix` runs
    as root: it writes the matrix volume)."""
    return {name: svc for name, svc in in_profile(compose(), profile).items()
            if svc.get("image", "").startswith("morphoweb:") and str(svc.get("user", "")) != "0"}


def written_paths(service: dict) -> set[str]:
    """The directories a service of the image writes: its writable volumes' mount points, the
    state folder, and CuPy's kernel cache where it is set."""
    env = {**image_env(), **service.get("environment", {})}
    paths = {env["MORPHO_VAR_DIR"]}
    if "CUPY_CACHE_DIR" in env:
        paths.add(env["CUPY_CACHE_DIR"])
    for volume in service.get("volumes", []):
        parts = volume.split(":")
        if len(parts) == 2 or parts[2] != "ro":
            paths.add(parts[1])
    return paths


def owned_by_user() -> set[str]:
    """The paths the user step gives to the image's user (`chown USER PATH...`)."""
    user, _ = image_user()
    owned = set()
    for command in user_step():
        words = command.split()
        if words[:1] == ["chown"] and user in words:
            owned.update(words[words.index(user) + 1:])
    return owned


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_the_image_user_owns_every_path_it_writes(profile):
    """A named volume mounted on a path of the image takes that path's owner; one mounted where the
    image has nothing is root's, and the uid 1000 engine then cannot make CuPy's kernel cache."""
    owned = owned_by_user()
    services = image_services(profile)
    assert {"engine-a", "engine-b"} <= set(services) or profile == "cpu"
    for name, service in services.items():
        for path in written_paths(service):
            # the path itself, or the closest folder of it the image makes, is the user's
            made = [p for p in owned if path == p or path.startswith(p.rstrip("/") + "/")]
            assert made, f"{name} writes {path}, which the image does not give its user"
    gpu_engines = [svc for name, svc in services.items() if name in ("engine-a", "engine-b")]
    for service in gpu_engines:
        assert service["environment"]["CUPY_CACHE_DIR"].startswith("/cache/")
        assert "kernelcache:/cache" in service["volumes"]


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the user step as root, then writes as uid 1000")
def test_the_user_step_run_here_lets_that_user_write_every_path():
    """The Dockerfile's user step with its paths under a folder here (useradd left out: the uid is
    what counts), then each path every service writes, written as the image's uid, as CuPy makes
    its cache (mkdir -p) and the parties their files."""
    user, uid = image_user()
    root = tempfile.mkdtemp(prefix="morpho-image-", dir="/tmp")
    try:
        os.chmod(root, 0o755)  # the image's uid walks through it
        for command in user_step():
            if command.startswith("useradd"):
                continue
            rerooted = re.sub(r"(?<=\s)/", root + "/", command)
            rerooted = re.sub(rf"^chown {user}\b", f"chown {uid}", rerooted)
            subprocess.run(["sh", "-c", rerooted], check=True)
        paths = set()
        for profile in ("gpu", "cpu"):
            for service in image_services(profile).values():
                paths |= written_paths(service)
        for path in sorted(paths):
            here = root + path
            # a mount point the image lacks is made by Docker, as root
            os.makedirs(os.path.dirname(here), exist_ok=True)
            if not os.path.exists(here):
                os.mkdir(here, 0o755)
            wrote = subprocess.run(["sh", "-c", 'mkdir -p "$1/sub" && : > "$1/sub/probe"', "sh",
                                    here], user=uid, group=uid, capture_output=True, text=True,
                                   check=False)
            assert wrote.returncode == 0, f"uid {uid} cannot write {path}: {wrote.stderr}"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_each_party_migrates_once_before_its_engine_web_and_worker_start():
    """The engine server reads the policies and epochs as it starts: on a fresh database it logged
    `no such table` tracebacks while the web server migrated."""
    for profile in ("gpu", "cpu"):
        services = in_profile(compose(), profile)
        for name, service in image_services(profile).items():
            if name.startswith("migrate-"):
                continue
            party = service["environment"]["DATABASE_URL"].rsplit("_", 1)[1]
            migrate = f"migrate-{party}"
            assert service["depends_on"][migrate] == {"condition": "service_completed_successfully"}, name
            assert services[migrate]["environment"]["DATABASE_URL"] == service["environment"]["DATABASE_URL"]
            assert services[migrate]["command"] == ["python", "manage.py", "migrate", "--no-input"]
            assert services[migrate]["restart"] == "no"


@pytest.fixture(scope="module")
def cpu_image(tmp_path_factory):
    """A clean venv after the Dockerfile's install step with MORPHO_EXTRAS="" (the CPU image)."""
    root = tmp_path_factory.mktemp("image")
    bin_dir = make_venv(root / "venv")
    context = build_context(root)
    # The step exactly, but with pip's cache: --no-cache-dir only keeps the image small.
    step = install_step().replace("--no-cache-dir ", "")
    done = subprocess.run(["sh", "-c", step], cwd=context, capture_output=True, text=True,
                          timeout=1200, check=False, env={**pip_env(bin_dir), "MORPHO_EXTRAS": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return bin_dir, context


@pytest.mark.docker
@pytest.mark.processes
def test_the_cpu_image_installs_and_runs_the_project(cpu_image, tmp_path):
    bin_dir, context = cpu_image
    # the step removes what it made and the protocol core's source: morpho-pir stays installed
    assert sorted(p.name for p in context.iterdir()) == ["README.md", "pyproject.toml"]
    listed = subprocess.run([bin_dir / "python", "-m", "pip", "list", "--format=json"],
                            capture_output=True, text=True, check=True, env=pip_env(bin_dir))
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"django", "djangorestframework", "celery", "numpy", "gunicorn", "psycopg"} <= names
    assert "morphoweb" not in names  # the code is copied in afterwards, not installed
    assert "morpho-pir" in names  # the protocol core stays installed
    assert not any(name.startswith(("cupy", "nvidia-")) for name in names)
    # The project's code on that environment, as the image runs it (the code is copied to /app).
    env = {**pip_env(bin_dir), "PYTHONPATH": str(REPO), "MORPHO_VAR_DIR": str(tmp_path),
           "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"}
    for args in (["manage.py", "check"], ["manage.py", "migrate", "--no-input", "-v0"]):
        done = subprocess.run([bin_dir / "python", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=300, check=False, env=env)
        assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.docker
@pytest.mark.processes
@pytest.mark.parametrize("extras, cupy, nvrtc, major", [
    ("cuda13", "cupy-cuda13x", "nvidia-cuda-nvrtc", "13"),
    ("cuda12", "cupy-cuda12x", "nvidia-cuda-nvrtc-cu12", "12"),
])
def test_a_cuda_image_brings_nvrtc(cpu_image, tmp_path, extras, cupy, nvrtc, major):
    bin_dir, _ = cpu_image
    context = build_context(tmp_path)
    report = tmp_path / "report.json"
    done = subprocess.run(
        [bin_dir / "python", "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), "./pir", requirement(extras)],
        cwd=context, capture_output=True, text=True, timeout=1200, check=False,
        env=pip_env(bin_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    versions = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert cupy in versions and versions[cupy].split(".")[0] == "14"
    assert versions.get(nvrtc, "").split(".")[0] == major, sorted(versions)


@pytest.mark.docker
@pytest.mark.processes
@pytest.mark.gpu
def test_the_cuda_image_compiles_a_kernel_with_its_own_nvrtc(tmp_path):
    # MORPHO_TEST_IMAGE_EXTRAS=cuda12 on a host whose driver predates CUDA 13.
    extras = os.environ.get("MORPHO_TEST_IMAGE_EXTRAS", "cuda13")
    bin_dir = make_venv(tmp_path / "venv")
    context = build_context(tmp_path)
    step = install_step().replace("--no-cache-dir ", "")
    done = subprocess.run(["sh", "-c", step], cwd=context, capture_output=True, text=True,
                          timeout=3600, check=False,
                          env={**pip_env(bin_dir), "MORPHO_EXTRAS": extras})
    assert done.returncode == 0, done.stderr[-3000:]
    probe = (
        "from cupy_backends.cuda.libs import nvrtc\n"
        "import cupy\n"
        "print('nvrtc', nvrtc.getVersion())\n"
        "kernel = cupy.RawKernel(\n"
        "    r'extern \"C\" __global__ void seven(int* x) { x[0] = 7; }', 'seven')\n"
        "x = cupy.zeros(1, dtype=cupy.int32)\n"
        "kernel((1,), (1,), (x,))\n"
        "print('value', int(x[0]))\n"
        "maps = open('/proc/self/maps').read().splitlines()\n"
        "print('libs', sorted({line.split()[-1] for line in maps if 'nvrtc' in line}))\n"
    )
    # No system CUDA on the paths: what compiles is what the image's wheels brought.
    env = {k: v for k, v in pip_env(bin_dir).items()
           if k not in ("CUDA_PATH", "CUDA_HOME", "LD_LIBRARY_PATH")}
    ran = subprocess.run([bin_dir / "python", "-c", probe], capture_output=True, text=True,
                         timeout=600, check=False, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "value 7" in ran.stdout
    libs = ran.stdout.split("libs ", 1)[1]
    assert str(tmp_path / "venv") in libs, ran.stdout
