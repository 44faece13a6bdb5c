"""The kernels' own tests need the extension: without a compiler, or with KVSLIM_NO_EXTENSION=1,
they are skipped (the rest of the suite then runs torch's kernels)."""
from pathlib import Path

import pytest

from kvslim.kernels import extension

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    reason = extension.missing_compiler()
    if reason is None and extension.disabled():
        reason = "KVSLIM_NO_EXTENSION=1: the extension is disabled"
    if reason is None:
        return
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.skip(reason=reason))
