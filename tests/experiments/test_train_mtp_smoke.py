"""experiments/training/train_mtp.py trains an MTP layer for the embedded model (two steps here),
and the parameters it writes load back for the model with an MTP layer, unchanged."""

import jax
import numpy as np


def test_smoke(load_experiment, tmp_path, capsys):
    from fo_jax.embedded import load_embedded

    train_mtp = load_experiment("train_mtp")
    out = tmp_path / "mtp.npz"
    train_mtp.main(["--steps", "2", "--batch", "2", "--length", "16", "--eval-windows", "2",
                    "--max-bytes", "50000", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "step     2  held-out loss" in printed and "top-1 of t+2" in printed
    config = load_embedded()[0].replace(num_nextn_predict_layers=1)
    mtp = train_mtp.load_mtp(str(out), config)
    saved = np.load(out)
    leaves = jax.tree_util.tree_flatten_with_path(mtp)[0]
    assert len(leaves) == len(saved.files)
    for path, leaf in leaves:
        np.testing.assert_array_equal(np.asarray(leaf), saved[jax.tree_util.keystr(path)])
