"""fleetheal.slurm.gres: the one GPU count of TRES strings (fleet status's queue, the queue replay's sacct)."""

from __future__ import annotations

import pytest

from fleetheal.slurm.gres import tres_gpus


def test_untyped_count_wins_over_the_typed_ones_beside_it() -> None:
    assert tres_gpus("cpu=2,node=1,gres/gpu=4,gres/gpu:h100=4") == 4
    assert tres_gpus("cpu=2,node=1,gres/gpu:h100=4,gres/gpu:a100=2") == 6
    assert tres_gpus("cpu=1,mem=100M,node=1") == 0


def test_a_gpu_count_that_is_no_number_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"'gres/gpu=x' in TRES 'cpu=1,gres/gpu=x'"):
        tres_gpus("cpu=1,gres/gpu=x")
    assert tres_gpus("cpu=1,mem=1G") == 0  # other fields are not read
