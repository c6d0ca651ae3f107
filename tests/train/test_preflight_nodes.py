"""``coordexp preflight --nnodes N --nproc-per-node M``: what each node of a multi-node launch needs (issue 55)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.runtime.train.preflight_nodes import file_system_type, node_checks

runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, ["preflight", *map(str, args)])
    return result.exit_code, result.output


def test_nodes_check_says_the_per_rank_batch_accumulation_decode_batch_and_the_shared_folder(write_config, tmp_path):
    cfg = write_config({"training": {"per_device_train_batch_size": 2, "effective_batch_size": 32,
                                     "output_dir": str(tmp_path / "runs" / "x")},
                        "rollout_matching": {"decode_batch_size": 4}})
    code, out = invoke(cfg, "--json", "--nnodes", 2, "--nproc-per-node", 4)
    assert code == 0, out
    report = json.loads(out)
    nodes = report["wiring"]["nodes"]
    assert (nodes["world_size"], nodes["per_rank_train_batch"], nodes["accumulation"], nodes["global_batch"]) == (
        8, 2, 2, 32)
    assert nodes["decode_batch_size"] == 4 and nodes["shared_paths"]["training.output_dir"] == str(
        tmp_path / "runs" / "x")
    [check] = [c for c in report["checks"] if c["name"] == "nodes"]
    detail = check["detail"]
    assert "2 node(s) x 4 rank(s) = world size 8" in detail and "per_device_train_batch_size 2" in detail
    assert "accumulation 2 from training.effective_batch_size: a global batch of 32" in detail
    assert "decode_batch_size 4 is per rollout engine" in detail
    assert f"training.output_dir {tmp_path / 'runs' / 'x'} at the same path on a shared file system" in detail
    # the same world size without --nnodes says nothing about nodes
    code, out = invoke(cfg, "--json", "--learner-world-size", 8)
    assert code == 0 and "nodes" not in json.loads(out)["wiring"]


def test_an_effective_batch_the_nodes_do_not_divide_exits_2_naming_the_product(write_config):
    cfg = write_config({"training": {"per_device_train_batch_size": 2, "effective_batch_size": 24}})
    code, out = invoke(cfg, "--json", "--nnodes", 2, "--nproc-per-node", 4)
    assert code == 2, out
    [check] = [c for c in json.loads(out)["checks"] if c["name"] == "nodes"]
    assert not check["ok"] and "2 node(s) x 4 rank(s) = 16" in check["detail"]
    code, out = invoke(cfg, "--json", "--nnodes", 3, "--nproc-per-node", 4)  # 24 / (2 x 12) = 1
    assert code == 0, out


def test_a_world_size_given_twice_must_agree(write_config):
    code, out = invoke(write_config({}), "--learner-world-size", 3, "--nnodes", 2, "--nproc-per-node", 2)
    assert code == 2 and "--learner-world-size 3 differs from --nnodes 2 x --nproc-per-node 2 = 4" in " ".join(
        out.split())


def test_a_folder_on_a_local_file_system_is_a_warning_on_several_nodes_only(write_config, tmp_path):
    from coordexp.schema.contract import load_contract

    tmp_path = tmp_path.resolve()
    (tmp_path / "shared").mkdir()  # the mount point exists; the run folder under it not yet
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/export {tmp_path / 'shared'} nfs4 rw 0 0\n")
    assert file_system_type(tmp_path / "shared" / "runs" / "new", mounts) == "nfs4"  # nearest existing: the mount
    assert file_system_type(tmp_path / "local", mounts) == "ext4"
    local = load_contract(write_config({"training": {"output_dir": str(tmp_path / "local" / "run")},
                                        "data": {"val_jsonl": None}}))
    checks, _ = node_checks(local, 2, 1, mounts=str(mounts))
    warned = [c for c in checks if c.name == "shared folder"]
    assert len(warned) == 1 and warned[0].warning and warned[0].ok
    assert f"training.output_dir {tmp_path / 'local' / 'run'} (ext4)" in warned[0].detail
    checks, _ = node_checks(local, 1, 4, mounts=str(mounts))  # one node: nothing to share
    assert [c.name for c in checks] == ["nodes"]
