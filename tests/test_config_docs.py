"""docs/configuration.md is the generator's output, and the generator covers every key."""

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, Field

from deploy import config_docs
from deploy.config import AutoscalingConfig, ServiceConfig
from engine.config import EngineConfig
from policies import TrafficClass
from router.tenants import ApiKeyConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_committed_configuration_md_is_the_generators_output():
    assert DOC.read_text() == config_docs.render(), (
        "docs/configuration.md is stale: run python -m deploy.config_docs > docs/configuration.md"
    )


def test_check_flag_fails_on_a_stale_file(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(config_docs.render().replace("token budget", "token allowance"))
    assert config_docs.main(["--check", str(stale)]) == 1
    stale.write_text(config_docs.render())
    assert config_docs.main(["--check", str(stale)]) == 0


@pytest.mark.parametrize(
    ("model", "prefix"),
    [
        (ServiceConfig, ""),
        (AutoscalingConfig, "autoscaling."),
        (EngineConfig, "engine."),
        (ApiKeyConfig, "api_keys.KEY."),
    ],
)
def test_every_field_has_a_row_with_a_meaning(model, prefix):
    text = config_docs.render()
    for name in model.model_fields:
        if model is EngineConfig and name == "model":
            continue  # set at the top level
        assert f"| `{prefix}{name}` |" in text, name
    for row in config_docs.model_rows(model, prefix):
        assert row[3].strip(), row


def test_every_traffic_class_field_has_a_row():
    text = config_docs.render()
    for name in TrafficClass.__dataclass_fields__:
        if name != "name":
            assert f"| `engine.traffic_classes.NAME.{name}` |" in text, name


def test_a_field_without_a_description_is_refused():
    class Undocumented(BaseModel):
        documented: int = Field(1, description="has one")
        bare: int = 2

    with pytest.raises(ValueError, match="Undocumented.bare has no description"):
        list(config_docs.model_rows(Undocumented))


def test_server_defaults_shown_beside_the_engines():
    assert "| `engine.policy` |" in config_docs.render()
    assert '`"fcfs"` (`iterserve serve`: `"priority"`)' in config_docs.render()


def test_autoscaling_fields_have_rows_and_num_replicas_shows_auto():
    text = config_docs.render()
    for name in AutoscalingConfig.model_fields:
        assert f"| `autoscaling.{name}` |" in text, name
    (row,) = [r for r in config_docs.model_rows(ServiceConfig) if r[0] == "`num_replicas`"]
    assert row[1] == 'integer, >= 1; or `"auto"`'
    assert ServiceConfig(num_replicas="auto").autoscaling == AutoscalingConfig()


def test_yaml_examples_are_valid_service_configs():
    blocks = re.findall(r"```yaml\n(.*?)```", config_docs.render(), flags=re.S)
    assert len(blocks) == 2
    configs = [ServiceConfig(**yaml.safe_load(b)) for b in blocks]
    assert configs[1].autoscaling == AutoscalingConfig(
        min_replicas=1, max_replicas=4, scale_down_delay_s=300
    )
