import json

from moe.plan.activations import CALIBRATION


def test_calibration_table_names_its_device_and_torch():
    table = json.loads(CALIBRATION.read_text())
    assert table["device"] and table["torch"] and table["git_commit"]
    assert set(table["layer_factor"]) == {"none", "matmuls", "selective", "full"}
