import pytest


@pytest.fixture
def anyio_backend() -> str:
    # The gateway and simulator run on asyncio (uvicorn); test on the same backend.
    return "asyncio"
