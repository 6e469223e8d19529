"""The config validates names without importing torch; keep its lists equal to the registries."""

from asyncrl.algo import advantages, agg, kl, losses, rejection
from asyncrl.config import validate


def test_config_name_lists_match_algorithm_registries():
    assert set(validate.LOSS_MODES) == set(losses.POLICY_LOSSES)
    assert set(validate.LOSS_AGG_MODES) == set(agg.LOSS_AGG_MODES)
    assert set(validate.KL_TYPES) == set(kl.KL_TYPES)
    assert set(validate.ADV_ESTIMATORS) == set(advantages.ADV_ESTIMATORS)
    assert set(validate.RS_CRITERIA) == set(rejection.RS_CRITERIA)
