"""Shared mode's release plan: the KV cache alone when both copies of the weights fit (shrinking the
server's pool to make room), the weights too when they do not, and loud errors where "kv_cache" was asked
for and cannot work. The co-resident plan: a pool that leaves the trainer its model and activations, or
an error naming the alternatives."""

from __future__ import annotations

from pathlib import Path

import pytest

from art_sglang.errors import ConfigError
from art_sglang.planning.gpu_budget import (
    GIB,
    TRAINER_OVERHEAD_BYTES,
    model_weights_bytes,
    plan_co_resident,
    plan_shared_gpu,
)

H100 = 80 * GIB


def plan(requested="auto", *, weights=3 * GIB, total=H100, fraction=0.9, user=False):
    return plan_shared_gpu(
        requested,
        gpu_total_bytes=total,
        weights_bytes=weights,
        mem_fraction_static=fraction,
        fraction_set_by_user=user,
    )


def test_small_model_keeps_weights_and_shrinks_the_pool_for_the_trainer() -> None:
    chosen = plan(weights=3 * GIB)
    assert chosen.release == "kv_cache" and chosen.trainer_resident
    # The trainer's copy plus its overhead sits outside the pool, with SGLang's headroom kept.
    outside = H100 * (1 - chosen.mem_fraction_static)
    assert outside >= 3 * GIB + TRAINER_OVERHEAD_BYTES + 0.1 * H100 - 0.01 * GIB
    assert chosen.mem_fraction_static < 0.9


def test_7b_on_80gb_still_fits_and_too_big_a_model_releases_everything() -> None:
    assert plan(weights=int(15.2 * GIB)).release == "kv_cache"
    big = plan(weights=33 * GIB)
    assert big.release == "all" and not big.trainer_resident
    assert big.mem_fraction_static == 0.9  # the pool is left as configured
    with pytest.raises(ConfigError, match="sleep_release='all'"):
        plan("kv_cache", weights=33 * GIB)


def test_users_fraction_is_kept_or_named_in_the_error() -> None:
    assert plan(weights=3 * GIB, fraction=0.8, user=True).mem_fraction_static == 0.8
    assert plan(weights=3 * GIB, fraction=0.97, user=True).release == "all"
    with pytest.raises(ConfigError, match=r"mem_fraction_static=0.97 leaves 2.4 GiB"):
        plan("kv_cache", weights=3 * GIB, fraction=0.97, user=True)


def test_unknown_size_and_no_gpu() -> None:
    assert plan(weights=None).release == "all"
    with pytest.raises(ConfigError, match="weight files were not found"):
        plan("kv_cache", weights=None)
    assert plan("kv_cache", weights=None, fraction=0.6, user=True).release == "kv_cache"
    assert plan(total=None).release == "kv_cache"
    assert plan("all", total=None).release == "all"


def test_weight_bytes_of_a_local_model(tiny_model_path: Path, tmp_path: Path) -> None:
    size = sum(f.stat().st_size for f in tiny_model_path.glob("*.safetensors"))
    assert model_weights_bytes(str(tiny_model_path)) == size > 0
    assert model_weights_bytes(str(tmp_path)) is None
    assert model_weights_bytes("no-such-org/no-such-model") is None


def co_resident(*, weights=3 * GIB, total=141 * GIB, fraction=0.9, user=False):
    return plan_co_resident(
        gpu_total_bytes=total, weights_bytes=weights, mem_fraction_static=fraction, fraction_set_by_user=user
    )


def test_co_resident_splits_what_both_copies_leave_between_kv_cache_and_training() -> None:
    fraction = co_resident(weights=3 * GIB)  # a 1.5B model on an H200
    kv = fraction - 3 / 141
    training = 1 - 0.1 - fraction - (3 * GIB + TRAINER_OVERHEAD_BYTES) / (141 * GIB)
    assert kv > 0.3 and abs(kv - training) < 0.01
    assert co_resident(weights=3 * GIB, fraction=0.3, user=True) == 0.3  # the user's, when it fits
    assert co_resident(weights=3 * GIB, total=None) == 0.9  # no GPU: nothing to share


def test_co_resident_that_does_not_fit_names_the_alternatives() -> None:
    with pytest.raises(ConfigError, match=r"shared_strategy='sleep'.*split mode"):
        co_resident(weights=33 * GIB, total=80 * GIB)
    with pytest.raises(ConfigError, match="for training"):
        co_resident(weights=3 * GIB, fraction=0.85, user=True)
    with pytest.raises(ConfigError, match="mem_fraction_static"):
        co_resident(weights=None)
