import os

import pytest
from hypothesis import HealthCheck, settings

# Every Ray the tests start listens on 127.0.0.1, as rlcore-run's own does (runtime/cluster/loopback.py): servers
# launched on a Ray node bind the node's address, and traffic to the machine's routable address may not reach them.
# Set before any test module imports Ray, which reads it then.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def no_tf32():
    """TF32 off for the test (CUDA matmuls and cuDNN in true float32), restored after it."""
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
