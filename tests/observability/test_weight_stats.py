"""Weight statistics per parameter group, computed on device, equal numpy's."""

import jax
import numpy as np
import pytest
from flax import nnx
from obs_helpers import tiny_model

from jaxtrain.observability import weights


def test_group_statistics_match_numpy_over_all_layers():
    params = nnx.state(tiny_model(), nnx.Param)
    groups = weights.parameter_groups(params)
    assert "model/layers/all/mlp/down_proj/kernel" in groups
    assert len(groups["model/layers/all/mlp/down_proj/kernel"]) == 2  # both layers
    stats = jax.device_get(jax.jit(weights.make_weight_stats_fn(params))(params))

    model = tiny_model()
    x = np.concatenate([np.ravel(layer.mlp.down_proj.kernel[...]) for layer in model.model.layers])
    got = stats["model/layers/all/mlp/down_proj/kernel"]
    assert float(got["mean"]) == pytest.approx(x.mean(), abs=1e-7)
    assert float(got["std"]) == pytest.approx(x.std(), rel=1e-5)
    assert float(got["min"]) == x.min() and float(got["max"]) == x.max()
    assert float(got["norm"]) == pytest.approx(np.linalg.norm(x), rel=1e-5)
    hist = weights.histogram(got)
    assert sum(hist["bucket_counts"]) == x.size and len(hist["bucket_limits"]) == 64
    assert hist["bucket_limits"][-1] == pytest.approx(x.max())
    logs = weights.scalar_logs(stats)
    assert logs["weights/model/layers/all/mlp/down_proj/kernel/norm"] == float(got["norm"])
