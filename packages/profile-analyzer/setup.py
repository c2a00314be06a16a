"""The compiled slice scanner of the trace loader (src/profile_analyzer/loaders/_scan.c). ``optional``: where no C
compiler is at hand the package still installs, and the loader reads every slice with msgspec (same results,
slower; ``profile_analyzer.loaders._columns.SCAN_AVAILABLE`` says which)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("profile_analyzer.loaders._scan", ["src/profile_analyzer/loaders/_scan.c"],
                             extra_compile_args=["-O2"], optional=True)])
