"""The operator sets `naiad serve --frontend-workers` from the pod's CPU limit or request, less the engine's CPU."""

from __future__ import annotations

import pytest

from naiad_operator.server_spec import frontend_workers, server_args


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        ({}, None),
        ({"requests": {"memory": "1Gi"}}, None),
        ({"requests": {"cpu": "500m"}}, 1),
        ({"requests": {"cpu": "2"}}, 1),  # one CPU is the engine's
        ({"requests": {"cpu": 3}}, 2),
        ({"requests": {"cpu": "1500m"}}, 1),
        ({"requests": {"cpu": "2"}, "limits": {"cpu": "8"}}, 7),
        ({"limits": {"cpu": "3.5"}}, 3),
        ({"limits": {"cpu": "not-a-quantity"}}, None),
    ],
)
def test_frontend_workers_from_cpus(resources, expected):
    assert frontend_workers({"resources": resources}) == expected


def test_server_args_carry_the_flag_unless_the_user_sets_it():
    spec = {"resources": {"limits": {"cpu": "4"}}}
    assert "--frontend-workers=3" in server_args(spec)
    user = server_args({**spec, "args": ["--frontend-workers=1"]})
    assert [a for a in user if a.startswith("--frontend-workers")] == ["--frontend-workers=1"]
    assert not any(a.startswith("--frontend-workers") for a in server_args({}))
