import os

import pytest
from hypothesis import HealthCheck, settings
from suite_tools import RankPool, ranks_first, ray_module_order

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

# ---------------------------------------------------------------- one Ray for neighbouring modules
# A local Ray costs about 7 s to start and stop on a quiet 2-core machine. Modules that take the ``ray_session``
# fixture declare the Ray they need in RAY_RESOURCES (ray.init's num_cpus/num_gpus; 2 CPUs when absent); they run
# together at the end of the suite, grouped by those resources, and a module's Ray stays up for the next module when
# that one asks for the same resources. A module's leftovers cannot reach the next one: its module fixtures (engines,
# fleets, trainers) are torn down before its Ray is handed on, and a Ray with any CPU or GPU still held is restarted.
RAY_DEFAULT_RESOURCES = {"num_cpus": 2}
_RESOURCE_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU"}


def ray_resources(module) -> tuple[tuple[str, int], ...]:
    """The Ray a module's ``ray_session`` asks for, as a sortable key."""
    wanted = getattr(module, "RAY_RESOURCES", RAY_DEFAULT_RESOURCES)
    unknown = set(wanted) - set(_RESOURCE_NAMES)
    if unknown:
        raise ValueError(
            f"{module.__name__}.RAY_RESOURCES: unknown keys {sorted(unknown)}; known {list(_RESOURCE_NAMES)}"
        )
    return tuple(sorted(wanted.items()))


def _ray_key(item):
    """The Ray resources the item's module asks for, or None when the item takes no ``ray_session``."""
    module = getattr(item, "module", None)
    return ray_resources(module) if module is not None and "ray_session" in getattr(item, "fixturenames", ()) else None


@pytest.hookimpl(trylast=True)  # after -m / -k deselection: the hand-ons are between the modules that will run
def pytest_collection_modifyitems(session, config, items):
    """Modules whose tests take ``ray_session`` run last, grouped by the Ray they ask for (``ray_module_order``); the
    modules that take ``gloo_ranks`` and no Ray run first (``ranks_first``); each module's tests keep their order, and
    the other modules theirs."""
    modules: dict = {}
    for item in items:
        modules.setdefault(getattr(item, "module", None), []).append(item)
    groups = list(modules.values())
    keys = [min(filter(None, map(_ray_key, group)), default=None) for group in groups]
    order, hand_on = ray_module_order(keys)
    # The modules that take ``gloo_ranks`` and no Ray run first, together, so their ranks start once.
    pooled = [any("gloo_ranks" in getattr(item, "fixturenames", ()) for item in group) for group in groups]
    order, ranks_hand_on = ranks_first(order, keys, pooled)
    items[:] = [item for i in order for item in groups[i]]
    config.stash[_HAND_ON] = {group[0].module: hand_on[i] for i, group in enumerate(groups) if keys[i] is not None}
    config.stash[_RANKS_HAND_ON] = {group[0].module: ranks_hand_on[i] for i, group in enumerate(groups)}


_HAND_ON = pytest.StashKey[dict]()
_RANKS_HAND_ON = pytest.StashKey[dict]()


def _ray_matches(ray, wanted: tuple[tuple[str, int], ...], *, settle_s: float = 5.0) -> bool:
    """Whether the running Ray has exactly these CPUs and GPUs, all free (freed resources may take a moment)."""
    import time

    total = {_RESOURCE_NAMES[name]: float(count) for name, count in wanted}
    total.setdefault("GPU", 0.0)
    cluster = ray.cluster_resources()
    if {name: cluster.get(name, 0.0) for name in total} != total:
        return False
    deadline = time.monotonic() + settle_s
    while True:
        free = ray.available_resources()
        if {name: free.get(name, 0.0) for name in total} == total:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@pytest.fixture(scope="module")
def ray_session(request):
    """A local Ray with the module's RAY_RESOURCES, the previous module's when it asked for the same and left
    nothing running; shut down after the module unless the next module asks for the same."""
    import ray

    wanted = ray_resources(request.module)
    if ray.is_initialized() and not _ray_matches(ray, wanted):
        ray.shutdown()
    if not ray.is_initialized():
        ray.init(**dict(wanted), include_dashboard=False, log_to_driver=False)
    yield
    if not request.config.stash.get(_HAND_ON, {}).get(request.module, False):
        ray.shutdown()


@pytest.fixture
def no_tf32():
    """TF32 off for the test (CUDA matmuls and cuDNN in true float32), restored after it."""
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---------------------------------------------------------------- two gloo ranks for neighbouring modules
# A Megatron test over two gloo ranks runs its per-rank function on ``gloo_ranks`` (``gloo_ranks.run(fn, *args)``,
# as ``torch.multiprocessing.spawn(fn, args, nprocs=2)``): two interpreters kept between tests (suite_tools.RankPool),
# handed on to the next module when it takes them too (those modules run first, together), restarted after a failed
# task. Each task still builds its own process group on its own port.
_RANKS: list[RankPool] = []


@pytest.fixture(scope="module")
def gloo_ranks(request):
    """Two ranks: the previous module's when it handed them on (restarted if a task of it failed), else fresh ones."""
    if not _RANKS:
        _RANKS.append(RankPool(2))
    yield _RANKS[0]
    if _RANKS and not request.config.stash.get(_RANKS_HAND_ON, {}).get(request.module, False):
        _RANKS.pop().close()


def pytest_sessionfinish(session, exitstatus):
    """Ranks handed on to a module that a selection then left out are stopped with the session."""
    while _RANKS:
        _RANKS.pop().close()


# ---------------------------------------------------------------- two tiny checkpoints (the SGLang fake's tests)
@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """Two tiny Llama checkpoints on the task's digits-and-signs alphabet, ``(A, B)``: the same shape, weights drawn
    with seeds 0 and 1. Made once per module that asks."""
    from runtime.demo.tiny_model import TinyModelSpec, make_tiny_model

    root = tmp_path_factory.mktemp("checkpoints")
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    return tuple(
        make_tiny_model(root / name, alphabet="0123456789+=", spec=spec, seed=seed) for seed, name in enumerate("ab")
    )


@pytest.fixture(scope="module")
def tiny_models_float64(tiny_checkpoints):
    """:func:`tiny_checkpoints` loaded in float64: the reference a server's float32 outputs are compared with."""
    import torch
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval() for d in tiny_checkpoints]
