"""Read a Python package's source without importing it: a source tree, an sdist (.tar.gz), a wheel (.whl), or the
installed package (located with importlib.util.find_spec, which does not execute it).

Nothing here imports the target code; :func:`open_source` only lists and reads files.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from dbo_runtime.errors import DBOConfigError

__all__ = ["PackageSource", "open_source", "installed_source", "runtime_source", "download_release",
           "REFERENCE_VLLM_ASCEND_VERSION", "REFERENCE_VLLM_VERSION", "normalize_name", "parse_requirement"]

_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".whl", ".zip")
# An archive is read into memory file by file; these bound what a small archive that expands to gigabytes (a gzip
# or zip bomb) can make it hold or walk. A vllm-ascend sdist holds about 10 MiB of Python (its largest file 252 KiB),
# a vLLM wheel about 25 MiB (326 KiB).
_MEMBER_MAX_BYTES = 16 << 20  # one file read (a module or a requirements file)
_READ_MAX_BYTES = 256 << 20  # all the files read, together
_TAR_WALK_MAX_BYTES = 2 << 30  # how far into the expanded .tar the walk goes


def _is_meta_file(name: str) -> bool:
    """Release files beside the package that say what it requires (read as text, never run)."""
    return name in ("PKG-INFO", "METADATA", "pyproject.toml", "setup.py") or (
        name.startswith("requirements") and name.endswith(".txt"))


def normalize_name(name: str) -> str:
    """A distribution name as PEP 503 compares them (``torch_npu`` == ``torch-npu``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*\(?\s*([^;#)]*)")


def parse_requirement(line: str) -> tuple[str, str] | None:
    """``"torch-npu==2.10.0.post4"`` (or ``"torch (==2.10.0)"``, ``"torch ==2.10.0+cpu; ..."``) -> (normalized
    name, specifier without spaces); None for an option line (``-r``, ``--index-url``), a comment or a blank."""
    if line.lstrip().startswith(("-", "#")):
        return None
    match = _REQUIREMENT.match(line)
    if not match:
        return None
    return normalize_name(match.group(1)), match.group(2).strip().replace(" ", "")


@dataclass
class PackageSource:
    """The files of one top-level package (``vllm_ascend`` or ``vllm``) from wherever they came."""

    package: str
    label: str
    kind: str  # "tree" | "sdist" | "wheel" | "installed"
    version: str | None
    _files: dict[str, str] = field(default_factory=dict, repr=False)  # path under the package root -> member
    _reader: object = field(default=None, repr=False)
    # The release's requirement files beside the package (requirements*.txt, pyproject.toml, setup.py, PKG-INFO or
    # a wheel's METADATA), by file name: where the release pins its dependencies.
    meta: dict[str, str] = field(default_factory=dict, repr=False)

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

    def paths(self) -> list[str]:
        """Every .py file of the package (paths relative to the package's parent)."""
        return sorted(self._files)

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

    def requirements(self) -> list[tuple[str, str, str]]:
        """Every dependency the release states, as (where, normalized name, specifier), most authoritative first:
        requirements.txt (what setup.py installs from; ``-r`` includes followed), the metadata's Requires-Dist,
        pyproject.toml ([project] dependencies, then [build-system] requires), quoted pins in setup.py."""
        found: list[tuple[str, str, str]] = []

        def add(where: str, line: str) -> None:
            parsed = parse_requirement(line)
            if parsed is not None:
                found.append((where, *parsed))

        def from_txt(name: str, seen: set[str]) -> None:
            if name in seen or name not in self.meta:
                return
            seen.add(name)
            for line in self.meta[name].splitlines():
                include = re.match(r"^\s*-r\s+(\S+)", line)
                if include:
                    from_txt(include.group(1).rsplit("/", 1)[-1], seen)
                else:
                    add(name, line)

        from_txt("requirements.txt", set())
        for name in ("PKG-INFO", "METADATA"):
            for line in self.meta.get(name, "").split("\n\n", 1)[0].splitlines():
                if line.startswith("Requires-Dist:") and "extra ==" not in line:
                    add(name, line.split(":", 1)[1])
        if "pyproject.toml" in self.meta:
            try:
                data = tomllib.loads(self.meta["pyproject.toml"])
            except tomllib.TOMLDecodeError:
                data = {}
            for line in data.get("project", {}).get("dependencies", []) or []:
                add("pyproject.toml [project] dependencies", str(line))
            for line in data.get("build-system", {}).get("requires", []) or []:
                add("pyproject.toml [build-system] requires", str(line))
        for quoted in re.findall(r"""["']([A-Za-z0-9][A-Za-z0-9._-]*\s*(?:==|>=|<=|~=|!=|<|>)[^"']*)["']""",
                                 self.meta.get("setup.py", "")):
            add("setup.py", quoted)
        return found


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


class _ReadBudget:
    """Refuses an archive's file larger than ``_MEMBER_MAX_BYTES`` before it is read, and files read past
    ``_READ_MAX_BYTES`` in all (sizes from the archive's headers; the readers stop at them)."""

    def __init__(self, path: Path, package: str) -> None:
        self.path, self.package, self.total = path, package, 0

    def take(self, name: str, size: int) -> None:
        self.total += size
        if size > _MEMBER_MAX_BYTES:
            raise _bad_input(self.path, self.package, f"{name} expands to {size >> 20} MiB, more than the "
                                                      f"{_MEMBER_MAX_BYTES >> 20} MiB read of one file")
        if self.total > _READ_MAX_BYTES:
            raise _bad_input(self.path, self.package, f"its source files expand to more than "
                                                      f"{_READ_MAX_BYTES >> 20} MiB in all")


def _from_tar(path: Path, package: str) -> PackageSource:
    # One sequential pass: a .tar.gz cannot seek backwards cheaply, so every .py of the package is read now.
    texts: dict[str, str] = {}
    meta: dict[str, str] = {}
    version = None
    budget = _ReadBudget(path, package)
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if member.offset_data + member.size > _TAR_WALK_MAX_BYTES:
                    raise _bad_input(path, package, f"expands past {_TAR_WALK_MAX_BYTES >> 30} GiB (at {member.name})")
                if not member.isfile():
                    continue
                parts = member.name.split("/")
                if len(parts) == 2 and _is_meta_file(parts[1]):
                    handle = tar.extractfile(member)
                    if handle is not None:
                        budget.take(member.name, member.size)
                        meta[parts[1]] = handle.read().decode("utf-8", errors="replace")
                        if parts[1] == "PKG-INFO":
                            version = _version_from_metadata_text(meta[parts[1]])
                    continue
                # sdist layout: <name>-<version>/<package>/...; accept the package at depth 0 or 1
                for depth in (1, 0):
                    if len(parts) > depth + 1 and parts[depth] == package:
                        rel = "/".join(parts[depth:])
                        if rel.endswith(".py") and rel not in texts:
                            handle = tar.extractfile(member)
                            if handle is not None:
                                budget.take(member.name, member.size)
                                texts[rel] = handle.read().decode("utf-8", errors="replace")
                        break
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise _bad_input(path, package, f"not a readable archive ({exc.__class__.__name__})") from None
    if f"{package}/__init__.py" not in texts:
        raise _bad_input(path, package, f"archive has no {package}/__init__.py")
    return PackageSource(package, str(path), "sdist", version, {k: k for k in texts}, texts, meta)


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
    budget = _ReadBudget(path, package)
    try:
        for info in zf.infolist():  # the modules are read later, on demand: their sizes are checked now
            if info.filename in files or (info.filename.endswith(".dist-info/METADATA")
                                          and info.filename.count("/") == 1):
                budget.take(info.filename, info.file_size)
    except DBOConfigError:
        zf.close()
        raise
    version = None
    meta: dict[str, str] = {}
    for name in names:
        if name.endswith(".dist-info/METADATA") and name.count("/") == 1:
            meta["METADATA"] = zf.read(name).decode("utf-8", errors="replace")
            version = _version_from_metadata_text(meta["METADATA"])
            break
    return PackageSource(package, str(path), "wheel", version, files, zf, meta)


def _from_tree(path: Path, package: str, *, kind: str = "tree", version: str | None = None,
               meta: dict[str, str] | None = None) -> PackageSource:
    if (path / package / "__init__.py").is_file():
        root = path
    elif path.name == package and (path / "__init__.py").is_file():
        root = path.parent
    else:
        raise _bad_input(path, package, f"no {package}/__init__.py under it")
    files: dict[str, str] = {}
    for file in (root / package).rglob("*.py"):
        files[file.relative_to(root).as_posix()] = str(file)
    if meta is None:  # a source tree or an unpacked sdist: the release files beside the package
        meta = {f.name: f.read_text(encoding="utf-8", errors="replace") for f in root.iterdir()
                if f.is_file() and _is_meta_file(f.name)}
        dist_infos = sorted(root.glob(f"{package}-*.dist-info/METADATA"))
        if not meta and len(dist_infos) == 1:  # the package directory of a site-packages
            meta["METADATA"] = dist_infos[0].read_text(encoding="utf-8", errors="replace")
            version = version or _version_from_metadata_text(meta["METADATA"])
    if version is None:
        pkg_info = root / "PKG-INFO"
        if pkg_info.is_file():
            version = _version_from_metadata_text(pkg_info.read_text(encoding="utf-8", errors="replace"))
        if version is None:
            version_py = root / package / "_version.py"
            if version_py.is_file():
                version = _version_from_version_py(version_py.read_text(encoding="utf-8", errors="replace"))
    return PackageSource(package, str(path), kind, version, files, None, meta)


def open_source(path: str | Path, package: str) -> PackageSource:
    """Open ``path`` (tree, sdist or wheel) as the source of ``package``; DBOConfigError when it is none of them."""
    p = Path(path)
    if not p.exists():
        raise _bad_input(p, package, "no such file or directory")
    if p.is_dir():
        return _from_tree(p, package)
    if not p.is_file():  # a FIFO would block the archive reader for a writer, a device would never end
        raise _bad_input(p, package, "not a directory and not a regular file")
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
    meta: dict[str, str] = {}
    try:
        dist = importlib.metadata.distribution(distribution)
        version = dist.version
        meta["METADATA"] = dist.read_text("METADATA") or ""
    except importlib.metadata.PackageNotFoundError:
        version = None
    # site-packages is not a source tree: its other files are not this release's
    return _from_tree(pkg_dir, package, kind="installed", version=version, meta=meta)


def runtime_source(module: str) -> tuple[str, str] | None:
    """(path shown in messages, text) of one of dbo_runtime's own modules, read as text: what the runtime passes to a
    vLLM-Ascend function is read from its source, never by importing it (the module may import torch_npu or vLLM)."""
    try:
        spec = importlib.util.find_spec(module)  # imports the parent packages only (dbo_runtime.ascend)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        text = Path(spec.origin).read_text(encoding="utf-8")
    except OSError:
        return None
    return module.replace(".", "/") + ".py", text


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
