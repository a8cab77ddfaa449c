import pytest

from rig_decode.config import ConfigError, RigConfig


def test_defaults_and_yaml_roundtrip(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: {max_tokens: 64, temperature: 0.5}\nrig: {max_iterations: 2, marker_style: json}\n")
    cfg = RigConfig.from_yaml(p)
    assert cfg.model.max_tokens == 64 and cfg.rig.marker_style == "json"
    assert cfg.retriever.top_k == RigConfig().retriever.top_k
    assert RigConfig.from_dict(cfg.model_dump()) == cfg


@pytest.mark.parametrize(
    "text, expected",
    [
        ("model: {max_tokenz: 3}", "model.max_tokenz: unknown key"),
        ("rig: {max_iterations: -1}", "rig.max_iterations: Input should be greater than or equal to 0"),
        ("rig: {marker_style: xml}", "rig.marker_style: Input should be 'special_token' or 'json'"),
        ("retriever: {top_k: many}", "retriever.top_k: Input should be a valid integer"),
        ("retriever: {type: faiss, top_k: 0}", "retriever.top_k"),
        ("server: {port: 70000}", "server.port"),
        ("engine: {zero_prefill: {select: middle}}", "engine.zero_prefill.select: Input should be 'tail' or 'deviation'"),
        ("modle: {}", "modle: unknown key"),
        ("- a\n- b", "top level must be a mapping"),
        ("model: {name: [unclosed", "invalid YAML"),
    ],
)
def test_bad_config_names_the_key(tmp_path, text, expected):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        RigConfig.from_yaml(p)
    assert expected in str(e.value) and str(p) in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        RigConfig.from_yaml(tmp_path / "nope.yaml")


def test_empty_file_means_defaults(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    assert RigConfig.from_yaml(p) == RigConfig()


def test_updated_validates():
    assert RigConfig().updated(rig={"max_iterations": 1}).rig.max_iterations == 1
    with pytest.raises(ConfigError, match="rig.max_iterations"):
        RigConfig().updated(rig={"max_iterations": "x"})
