"""Read a Python package's source without importing it: a source tree, an sdist (.tar.gz), a wheel (.whl), or the
installed package (located with importlib.util.find_spec, which does not execute it).

Nothing here imports the target code; :func:`open_source` only lists and reads files.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from dbo_runtime.errors import DBOConfigError

__all__ = ["PackageSource", "open_source", "installed_source", "download_release", "REFERENCE_VLLM_ASCEND_VERSION",
           "REFERENCE_VLLM_VERSION"]

_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".whl", ".zip")


@dataclass
class PackageSource:
    """The files of one top-level package (``vllm_ascend`` or ``vllm``) from wherever they came."""

    package: str
    label: str
    kind: str  # "tree" | "sdist" | "wheel" | "installed"
    version: str | None
    _files: dict[str, str] = field(default_factory=dict, repr=False)  # path under the package root -> member
    _reader: object = field(default=None, repr=False)

    def module_path(self, module: str) -> str | None:
        """Path (relative to the package's parent) of ``module``'s source, or None when it is not there."""
        parts = module.split(".")
        if parts[0] != self.package:
            return None
        base = "/".join(parts)
        for candidate in (base + ".py", base + "/__init__.py"):
            if candidate in self._files:
                return candidate
        return None

    def read(self, relpath: str) -> str:
        member = self._files[relpath]
        reader = self._reader
        if isinstance(reader, dict):  # an sdist, read in one pass at open
            return reader[member]
        if isinstance(reader, zipfile.ZipFile):
            return reader.read(member).decode("utf-8", errors="replace")
        return Path(member).read_text(encoding="utf-8", errors="replace")

    def close(self) -> None:
        if isinstance(self._reader, zipfile.ZipFile):
            self._reader.close()


def _version_from_metadata_text(text: str) -> str | None:
    match = re.search(r"^Version:\s*(\S+)", text, re.MULTILINE)
    return match.group(1) if match else None


def _version_from_version_py(text: str) -> str | None:
    match = re.search(r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""", text, re.MULTILINE)
    return match.group(1) if match else None


def _bad_input(path: Path, package: str, why: str) -> DBOConfigError:
    return DBOConfigError(
        f"{path}: {why}; expected a {package} source tree, sdist (.tar.gz) or wheel (.whl)"
    )


def _from_tar(path: Path, package: str) -> PackageSource:
    # One sequential pass: a .tar.gz cannot seek backwards cheaply, so every .py of the package is read now.
    texts: dict[str, str] = {}
    version = None
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                parts = member.name.split("/")
                if len(parts) == 2 and parts[1] == "PKG-INFO":
                    handle = tar.extractfile(member)
                    if handle is not None:
                        version = _version_from_metadata_text(handle.read().decode("utf-8", errors="replace"))
                    continue
                # sdist layout: <name>-<version>/<package>/...; accept the package at depth 0 or 1
                for depth in (1, 0):
                    if len(parts) > depth + 1 and parts[depth] == package:
                        rel = "/".join(parts[depth:])
                        if rel.endswith(".py") and rel not in texts:
                            handle = tar.extractfile(member)
                            if handle is not None:
                                texts[rel] = handle.read().decode("utf-8", errors="replace")
                        break
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise _bad_input(path, package, f"not a readable archive ({exc.__class__.__name__})") from None
    if f"{package}/__init__.py" not in texts:
        raise _bad_input(path, package, f"archive has no {package}/__init__.py")
    return PackageSource(package, str(path), "sdist", version, {k: k for k in texts}, texts)


def _from_zip(path: Path, package: str) -> PackageSource:
    try:
        zf = zipfile.ZipFile(path)
        names = zf.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise _bad_input(path, package, f"not a readable archive ({exc.__class__.__name__})") from None
    files = {name: name for name in names if name.startswith(package + "/") and name.endswith(".py")}
    if f"{package}/__init__.py" not in files:
        zf.close()
        raise _bad_input(path, package, f"archive has no {package}/__init__.py")
    version = None
    for name in names:
        if name.endswith(".dist-info/METADATA") and name.count("/") == 1:
            version = _version_from_metadata_text(zf.read(name).decode("utf-8", errors="replace"))
            break
    return PackageSource(package, str(path), "wheel", version, files, zf)


def _from_tree(path: Path, package: str, *, kind: str = "tree", version: str | None = None) -> PackageSource:
    if (path / package / "__init__.py").is_file():
        root = path
    elif path.name == package and (path / "__init__.py").is_file():
        root = path.parent
    else:
        raise _bad_input(path, package, f"no {package}/__init__.py under it")
    files: dict[str, str] = {}
    for file in (root / package).rglob("*.py"):
        files[file.relative_to(root).as_posix()] = str(file)
    if version is None:
        meta = root / "PKG-INFO"
        if meta.is_file():
            version = _version_from_metadata_text(meta.read_text(encoding="utf-8", errors="replace"))
        if version is None:
            version_py = root / package / "_version.py"
            if version_py.is_file():
                version = _version_from_version_py(version_py.read_text(encoding="utf-8", errors="replace"))
    return PackageSource(package, str(path), kind, version, files, None)


def open_source(path: str | Path, package: str) -> PackageSource:
    """Open ``path`` (tree, sdist or wheel) as the source of ``package``; DBOConfigError when it is none of them."""
    p = Path(path)
    if not p.exists():
        raise _bad_input(p, package, "no such file or directory")
    if p.is_dir():
        return _from_tree(p, package)
    name = p.name.lower()
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        return _from_tar(p, package)
    if name.endswith((".whl", ".zip")):
        return _from_zip(p, package)
    raise _bad_input(p, package, "not a directory and not an archive (" + ", ".join(_ARCHIVE_SUFFIXES) + ")")


def installed_source(package: str, distribution: str) -> PackageSource | None:
    """The installed ``package``, found without importing it; None when it is not installed."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return _from_tree(pkg_dir, package, kind="installed", version=version)


# The release the site table was written against, and the upstream vLLM its Dockerfile pins (VLLM_TAG).
REFERENCE_VLLM_ASCEND_VERSION = "0.23.0.post1"
REFERENCE_VLLM_VERSION = "0.23.0"


def _pip_python(cache_dir: Path) -> list[str]:
    """A Python with pip, setuptools and setuptools_scm (vllm-ascend's setup.py needs them to prepare metadata)."""
    import subprocess
    import venv

    env_dir = cache_dir / "pip-env"
    python = env_dir / "bin" / "python"
    stamp = env_dir / ".ready"
    if not stamp.exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
        proc = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "setuptools", "setuptools_scm", "wheel"],
            capture_output=True, text=True, timeout=300,
        )
        if proc.returncode != 0:
            raise DBOConfigError(f"could not prepare {env_dir} for pip download: {proc.stderr.strip()[-400:]}")
        stamp.touch()
    return [str(python), "-m", "pip"]


def download_release(cache_dir: str | Path, package: str, version: str, *, timeout_s: float = 600.0) -> Path:
    """Download (once) the release archive of ``vllm-ascend`` (sdist) or ``vllm`` (wheel) into ``cache_dir`` with
    pip, without dependencies and without installing it; return its path. DBOConfigError says why when it fails.

    vllm-ascend has only an sdist on PyPI and pip prepares its metadata by running setup.py: that needs
    setuptools_scm, no build isolation (the isolated env wants triton-ascend, which PyPI lacks) and SOC_VERSION
    set so that setup.py does not ask npu-smi for the chip.
    """
    import os
    import subprocess

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    stem = package.replace("-", "_")
    pattern = f"{stem}-{version}.tar.gz" if package == "vllm-ascend" else f"{stem}-{version}-*.whl"
    existing = sorted(cache.glob(pattern))
    if existing:
        return existing[0]
    pip = _pip_python(cache)
    staging = cache / f".download-{stem}-{version}"
    staging.mkdir(exist_ok=True)
    if package == "vllm-ascend":
        args = ["download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation", "-d", str(staging),
                f"vllm-ascend=={version}"]
    else:
        args = ["download", "--no-deps", "--only-binary", ":all:", "-d", str(staging), f"{package}=={version}"]
    env = dict(os.environ, SOC_VERSION=os.environ.get("SOC_VERSION", "ascend910b1"), COMPILE_CUSTOM_KERNELS="0")
    try:
        proc = subprocess.run([*pip, *args], capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise DBOConfigError(f"pip download {package}=={version} took more than {timeout_s:.0f}s") from None
    if proc.returncode != 0:
        tail = " | ".join(line for line in proc.stderr.strip().splitlines()[-5:] if "WARNING: Location" not in line)
        raise DBOConfigError(f"pip download {package}=={version} failed: {tail}")
    got = sorted(staging.glob(pattern))
    if not got:
        raise DBOConfigError(f"pip download {package}=={version} produced no {pattern} in {staging}")
    final = cache / got[0].name
    got[0].replace(final)  # a rename: a half-written download never appears under the final name
    for leftover in staging.iterdir():
        leftover.unlink()
    staging.rmdir()
    return final
