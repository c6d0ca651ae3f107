"""Saved weights are readable as a plain file would be: safetensors (0.8) writes 0600, which a server run as another
user cannot read; export-merged and expand-vocab widen them to 0o666 minus the umask (never narrowing)."""

from __future__ import annotations

import os
import stat

import pytest

from coordexp.runtime.model.checkpoint_files import share_saved_weights


@pytest.fixture()
def umask():
    def set_mask(mask: int) -> None:
        os.umask(mask)

    saved = os.umask(0o022)
    os.umask(saved)
    yield set_mask
    os.umask(saved)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_0600_weights_become_0644_under_umask_022_and_stay_private_under_077(tmp_path, umask):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    os.chmod(weights, 0o600)
    (tmp_path / "config.json").write_text("{}")
    umask(0o077)
    assert share_saved_weights(tmp_path) == [] and mode(weights) == 0o600
    umask(0o022)
    assert share_saved_weights(tmp_path) == [weights] and mode(weights) == 0o644
    os.chmod(weights, 0o664)
    assert share_saved_weights(tmp_path) == [] and mode(weights) == 0o664  # never narrowed


def test_what_safetensors_writes_is_widened(tmp_path, umask):
    """Regression (issue 44): the safetensors writer leaves 0600 behind whatever the umask."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    umask(0o022)
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    share_saved_weights(tmp_path)
    assert mode(tmp_path / "model.safetensors") == 0o644


def test_export_merged_and_expand_vocab_write_shareable_weights(tmp_path, umask):
    """Both write through merge_export's complete-folder writer, which widens what safetensors left 0600."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from coordexp.runtime.model import merge_export

    umask(0o022)
    out = tmp_path / "merged"
    merge_export._write_complete(out, lambda folder: save_file({"a": torch.zeros(2)},
                                                                str(folder / "model.safetensors")), "test")
    assert mode(out / "model.safetensors") == 0o644
