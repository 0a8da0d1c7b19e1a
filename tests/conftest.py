import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=200, deadline=None)
# the README's fast tier: fewer examples per property; .ci/run runs the property tests again
# with the "ci" profile's 40 (HYPOTHESIS_PROFILE=ci)
settings.register_profile(
    "fast", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))

# every tested torch runs the self-check at the first harden / backend / enable of each test
# process (nanpass/_selfcheck.py), as an untested one does for a user
os.environ.setdefault("NANPASS_SELFCHECK", "1")

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
