"""The MLflow model each mode logs, as code (MLflow's models-from-code), not as a pickle.

`mlflow.pyfunc.load_model` runs this file from the installed package's copy logged beside the
weights and reads the weights with `torch.load(weights_only=True)`, which builds tensors and plain
containers and refuses anything else: a pickled nn.Module, as `mlflow.pytorch` logs it, would run
whatever code anyone who can write to the artifact store put into it. `pipeline.tracking.model.load_model`
goes further and runs nothing from the store at all (docs/mlflow.md says which to use when).

In pipeline.tracking, the package whose modules alone import mlflow: MLflow executes it on load.
"""

from __future__ import annotations

import mlflow
from mlflow.pyfunc import PythonModel

WEIGHTS = "weights"  # the artifact's name: the mode's model.pt


def build_from_weights(path: str, allow: str | None = None):
    """The trained network from a model.pt, in eval mode: its workload is named in the file and
    builds it (one of this package's, or `allow`, the one the project's params name), its tensors
    loaded without unpickling anything."""
    from pathlib import Path

    import torch

    from pipeline.workloads import saved_workload

    saved = torch.load(path, map_location="cpu", weights_only=True)
    model = saved_workload(saved, Path(path), allow).build_model()
    model.load_state_dict(saved["state_dict"])
    return model.eval()


class MnistClassifier(PythonModel):
    """The workload's model on a batch shaped and typed as its example (MNIST's: normalised float32
    images, (N, 1, 28, 28), to logits; a text model's: integer token ids)."""

    # The model is logged with its signature; without this, MLflow asks for type hints on predict
    # (a warning on every log and load) and would wrap it to validate them.
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        # A workload of the project's own came with the model (its code_paths, on sys.path now), and
        # its class path in the model's config: running this file trusts the store's code already.
        own = (context.model_config or {}).get("workload")
        self.model = build_from_weights(context.artifacts[WEIGHTS], allow=own)

    def predict(self, context, model_input, params=None):
        import numpy as np
        import torch

        # Integer and boolean inputs (token ids) as they come, as the signature has them; the rest float32.
        array = np.asarray(model_input)
        if array.dtype.kind not in "iub":
            array = array.astype(np.float32)
        with torch.no_grad():
            return self.model(torch.as_tensor(array)).numpy()


mlflow.models.set_model(MnistClassifier())
