from datetime import timedelta

import pydantic
import pytest

from elastic.config import CollectiveConfig


def test_collective_config_defaults_are_gloo_ring():
    config = CollectiveConfig()
    assert config.backend == "gloo"
    assert config.algorithm == "ring"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"backend": "mpi"}, "backend"),
        ({"algorithm": "butterfly"}, "algorithm"),
        ({"timeout": timedelta(0)}, "timeout"),
        ({"segment_bytes": 10}, "segment_bytes"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_collective_config_names_the_field(kwargs, field):
    with pytest.raises(pydantic.ValidationError) as info:
        CollectiveConfig(**kwargs)
    assert field in str(info.value)


def test_config_is_frozen():
    config = CollectiveConfig()
    with pytest.raises(pydantic.ValidationError):
        config.backend = "nccl"


def test_every_config_field_has_a_description():
    import elastic.config as module

    models = [
        obj for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, pydantic.BaseModel)
        and obj.__module__ == module.__name__ and not obj.__name__.startswith("_")
    ]
    assert models
    for model in models:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_chaos_raise_outside_user_code_is_refused():
    from elastic.config import ChaosEvent

    with pytest.raises(pydantic.ValidationError, match="user code only"):
        ChaosEvent(step=1, rank=0, action="raise", phase="allreduce")
    assert ChaosEvent(step=1, rank=0, action="raise", phase="backward").phase == "backward"
