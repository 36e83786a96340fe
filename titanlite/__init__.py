"""titanlite: a small, readable, PyTorch-native LLM pre-training system."""

from importlib.metadata import PackageNotFoundError, version

__version__ = "0.1.0"

# The torch releases the test suite passed on (scripts/test_torch_versions.sh), as pyproject.toml's
# dependency says: context parallel on CPU uses private torch APIs that move between releases.
SUPPORTED_TORCH = ((2, 11), (2, 16))  # from 2.11 up to, not including, 2.16


def check_torch_version(installed: str) -> None:
    """ImportError, in one line, for a torch release outside SUPPORTED_TORCH."""
    major_minor = tuple(int(part) for part in installed.split("+")[0].split(".")[:2])
    low, high = SUPPORTED_TORCH
    if not low <= major_minor < high:
        newest = f"{high[0]}.{high[1] - 1}"
        raise ImportError(
            f"titanlite works with torch {low[0]}.{low[1]} to {newest}, not {installed}; "
            f"pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1]}'"
        )


try:
    check_torch_version(version("torch"))  # read from the package metadata: torch is not imported here
except PackageNotFoundError:
    pass  # no torch at all: its first import says so
