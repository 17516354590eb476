import pytest


@pytest.fixture(scope="session")
def embedded_dir():
    """The converted SmolLM2 cache (honours $HSPEC_CACHE_DIR); converts once per machine, ~30 s."""
    from sglang_hspec.assets.embedded import embedded_target_dir

    return embedded_target_dir()


@pytest.fixture(scope="session")
def embedded_target(embedded_dir):
    from sglang_hspec.assets.embedded import load_embedded_target

    return load_embedded_target()
