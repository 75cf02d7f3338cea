"""TensorBoard event files: the chief's reports as scalars, under `<output-dir>/tensorboard/`, so
the log shipper uploads them with the rest of the output and `trainop tensorboard JOB` serves them.

Each framework writes with its own writer: PyTorch with torch.utils.tensorboard's SummaryWriter
(which needs the `tensorboard` package: install.sh installs it with PyTorch), TensorFlow and
Keras with tf.summary (TensorFlow's own file writer, no extra package). Without a writer the run
goes on and says so once: the metrics file is still the contract.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

FOLDER = "tensorboard"  # inside --output-dir
# Report keys written as scalars, under TensorBoard tags grouped by section.
SCALARS = {"loss": "train/loss", "imagesPerSec": "throughput/images_per_sec",
           "imagesPerSecPerGPU": "throughput/images_per_sec_per_gpu", "stepTime": "throughput/step_time_s"}


class _Torch:
    def __init__(self, logdir: Path):
        # SummaryWriter writes through `tensorboard.compat.tf`, which imports the whole of
        # TensorFlow where it is installed beside PyTorch (a venv with both, as `trainop run
        # --local` and the tests use): 3 of a chief's 9 CPU-seconds of start-up on 2 cores, to
        # write local files. tensorboard's own stub writes them the same way; it is what the
        # PyTorch image (no TensorFlow) gets anyway. `tensorboard.compat.notf` is tensorboard's
        # switch to it (tensorboard/compat/__init__.py, its no_tensorflow build target).
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # one report per epoch: each is on disk before the next

    def close(self) -> None:
        self.writer.close()


class _TF:
    def __init__(self, logdir: Path):
        import tensorflow as tf
        from tensorflow.core.framework import summary_pb2

        self.tf = tf
        self.writer = tf.summary.create_file_writer(str(logdir))
        # What TensorBoard's own scalar summary writes: the scalars plugin and its data class.
        self.metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
            data_class=summary_pb2.DATA_CLASS_SCALAR)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        tf = self.tf
        with self.writer.as_default():
            for tag, value in values.items():
                tf.summary.write(tag, tf.constant(value, dtype=tf.float32), step=step, metadata=self.metadata)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_writer(framework: str, output_dir: Path):
    """A writer into `<output_dir>/tensorboard/` for the chief, or None (said on stderr) when the
    framework's writer cannot be loaded."""
    logdir = Path(output_dir) / FOLDER
    try:
        return _Torch(logdir) if framework == "pytorch" else _TF(logdir)
    except ImportError as exc:
        print(f"trainop_trainer: no TensorBoard event files ({exc}); install the `tensorboard` package",
              file=sys.stderr)
        return None


def scalars_of(record: dict) -> dict[str, float]:
    """A metrics report's values worth plotting, as TensorBoard tags."""
    return {tag: float(record[key]) for key, tag in SCALARS.items() if key in record}
