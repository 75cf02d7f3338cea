"""TensorFlow and Keras paths: a custom GradientTape loop (`tensorflow`) or `model.fit` (`keras`),
over Horovod or MultiWorkerMirroredStrategy.

Keras is `tf_keras` (Keras 2) on every path: Horovod's Keras optimizer wrapper silently averages
nothing under Keras 3, and one Keras API for both backends keeps the two paths comparable.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

# Must be set before TensorFlow is first imported: it picks tf.keras once.
os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from trainop_trainer import checkpoint, data, elastic, events, report  # noqa: E402
from trainop_trainer.config import Config  # noqa: E402
from trainop_trainer.world import World  # noqa: E402


def _tf_config(world: World) -> str:
    # One port per rank, after MASTER_PORT (which torchrun's own store holds): distinct even when
    # several ranks share a host.
    workers = [f"{host}:{world.master_port + 1 + i}" for i, host in enumerate(world.hosts)]
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": world.rank}})


def _resnet18(keras, image_size: int, classes: int):
    L = keras.layers

    def conv_bn(x, width, kernel, stride):
        x = L.Conv2D(width, kernel, stride, padding="same", use_bias=False)(x)
        return L.BatchNormalization()(x)

    inputs = keras.Input((image_size, image_size, 3))
    x = L.ReLU()(conv_bn(inputs, 64, 7, 2))
    x = L.MaxPooling2D(3, 2, padding="same")(x)
    for stage, width in enumerate((64, 128, 256, 512)):
        for block in range(2):
            stride = 2 if stage and not block else 1
            y = conv_bn(L.ReLU()(conv_bn(x, width, 3, stride)), width, 3, 1)
            shortcut = conv_bn(x, width, 1, stride) if stride != 1 or x.shape[-1] != width else x
            x = L.ReLU()(L.Add()([y, shortcut]))
    x = L.Dense(classes)(L.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, x, name="resnet18")


def _model(keras, cfg: Config, horovod: bool = False):
    if cfg.model == "resnet50":
        base = keras.applications.ResNet50(weights=None, input_shape=(cfg.image_size, cfg.image_size, 3),
                                           classes=cfg.num_classes, classifier_activation=None)
    else:
        base = _resnet18(keras, cfg.image_size, cfg.num_classes)
    # Logits in float32 under bf16, so the loss is computed in full precision.
    logits = keras.layers.Activation("linear", dtype="float64" if cfg.precision == "fp64" else "float32")(base.output)
    if cfg.elastic:
        return _accumulating_model(keras, cfg.accumulation, horovod)(base.input, logits)
    return keras.Model(base.input, logits)


def _accumulating_model(keras, accumulation: int, horovod: bool):
    """A functional model whose `fit` step (an elastic run's) takes `accumulation` stacked
    micro-batches, x (accumulation, batch, ...): their gradients, each of its micro-batch's mean
    loss, are averaged, all-reduced once under Horovod (the mean over the ranks) and applied. The
    optimizer (Horovod's wrapper, built by _compile) all-reduces only in compute_gradients, which
    this step does not call. Returns the class; "stepLoss": the step's mean loss on this rank."""
    import tensorflow as tf

    hvd = None
    if horovod:
        import horovod.tensorflow as hvd  # horovod.tensorflow.keras has no grouped_allreduce

    class Accumulating(keras.Model):
        def train_step(self, data):
            x, y = data
            summed, losses = None, []
            for a in range(accumulation):  # unrolled into the step's graph
                with tf.GradientTape() as tape:
                    y_pred = self(x[a], training=True)
                    loss = self.compute_loss(x[a], y[a], y_pred)
                grads = tape.gradient(loss, self.trainable_variables)
                summed = grads if summed is None else [s + g for s, g in zip(summed, grads)]
                losses.append(loss)
            grads = [g / accumulation for g in summed] if accumulation > 1 else summed
            if hvd is not None:
                grads = hvd.grouped_allreduce(grads, op=hvd.Average)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            metrics = self.compute_metrics(x[-1], y[-1], y_pred, None)
            return {**metrics, "stepLoss": tf.add_n(losses) / accumulation}

    return Accumulating


def _synthetic_part(tf, cfg: Config, part: int):
    """The synthetic batches of one stream: a rank's (`part` = its rank), or in an elastic run one
    part of the global batch, whichever rank trains on it (at the maximum world, part = rank)."""
    patterns, labels = data.synthetic_task(cfg.num_classes, cfg.synthetic_batches, cfg.batch_size, part, cfg.seed)
    reps = -(-cfg.image_size // data.PATTERN)
    shape = (cfg.synthetic_batches, cfg.batch_size, cfg.image_size, cfg.image_size, 3)
    noise = tf.random.stateless_normal(shape, seed=[cfg.seed + 1 + part, 0])
    tiled = tf.tile(tf.gather(patterns, labels), [1, 1, reps, reps, 1])[:, :, : cfg.image_size, : cfg.image_size]
    return noise + tiled, labels


def _dataset(tf, cfg: Config, world: World):
    """`make(start)`: this rank's batched dataset from global step `start` (the steps a resumed
    run trained before); its steps per epoch; its data.BadSamples and its plan (None: synthetic
    data). An elastic run's elements stack the step's micro-batches: x (accumulation, batch, ...)."""
    if cfg.synthetic:
        if cfg.elastic:
            streams = [_synthetic_part(tf, cfg, part) for part in cfg.elastic.parts(world.rank)]
            images, labels = tf.stack([s[0] for s in streams], 1), tf.stack([s[1] for s in streams], 1)
        else:
            images, labels = _synthetic_part(tf, cfg, world.rank)
        # Step k trains on batch k mod len: a resumed run continues the cycle where it stopped.
        ds = tf.data.Dataset.from_tensor_slices((images, labels)).repeat()
        return (lambda start: ds.skip(start % cfg.synthetic_batches)), 100, None, None
    dataset = data.scan(cfg.data_dir)
    mode = dataset.read_mode(cfg.read_mode)
    data.describe_shard(dataset, world.rank, world.size, cfg.data_dir, mode, cfg.elastic)
    bad_samples = data.BadSamples(dataset.samples, cfg.max_bad_samples)
    plan = data.make_plan(dataset, mode, world.rank, world.size, cfg.batch_size, cfg.seed, cfg.elastic)
    if cfg.elastic:
        accumulation = cfg.elastic.accumulation
        return (lambda start: _image_dataset(tf, dataset, plan, cfg, start * accumulation, bad_samples)
                .batch(accumulation, drop_remainder=True), plan.steps_per_epoch, bad_samples, plan)
    return (lambda start: _image_dataset(tf, dataset, plan, cfg, start, bad_samples),
            dataset.steps_per_epoch(world.size, cfg.batch_size, mode), bad_samples, plan)


def _image_dataset(tf, dataset: data.DataSet, plan, cfg: Config, start: int = 0,
                   bad_samples: data.BadSamples | None = None):
    """tf.data over the same `BatchPlan` and augmentation contract as the PyTorch loader.

    A Python generator names the samples in plan order (cheap); a parallel map reads each batch's
    bytes (tar blocks coalesced) and draws its crops with data.py's code (the GIL is held only for
    the read and the header parse); a second parallel map decodes with TensorFlow's own kernels
    (`decode_and_crop_jpeg` decodes only the crop window), outside the GIL on tf.data's threads;
    normalisation is one vectorised op per batch. AUTOTUNE sizes both maps and the prefetch.
    Batch n is a pure function of the plan: a resumed run starts the generator at batch `start`.
    The read goes through data.read_batch, as PyTorch's does: a bad sample is replaced in its slot
    before TensorFlow's decoder sees it, and noted in `bad_samples` (which the training loop checks)."""
    pool = plan.pool
    if bad_samples is None:
        bad_samples = data.BadSamples(dataset.samples, cfg.max_bad_samples)
    size, autotune = cfg.image_size, tf.data.AUTOTUNE

    def batch_keys():
        n = start
        while True:
            epoch, indices = plan.batch(n)
            yield epoch, indices
            n += 1

    def read(epoch, indices):
        picks, bad = data.read_batch(dataset.samples, pool, int(epoch), indices, cfg.seed, plan.stream)
        bad_samples.note(bad)  # never raises here (a tf.data thread): the training loop checks
        boxes = np.array([(p.crop.y, p.crop.x, p.crop.h, p.crop.w) for p in picks], dtype=np.int32)
        flips = np.array([p.crop.flip for p in picks], dtype=bool)
        labels = np.array([p.label for p in picks], dtype=np.int64)
        return np.array([p.raw for p in picks], dtype=object), boxes, flips, labels

    def read_tf(epoch, indices):
        raws, boxes, flips, labels = tf.numpy_function(read, [epoch, indices], (tf.string, tf.int32, tf.bool, tf.int64))
        return (tf.ensure_shape(raws, (cfg.batch_size,)), tf.ensure_shape(boxes, (cfg.batch_size, 4)),
                tf.ensure_shape(flips, (cfg.batch_size,)), tf.ensure_shape(labels, (cfg.batch_size,)))

    def decode_one(raw, box, flip):
        def jpeg():
            return tf.io.decode_and_crop_jpeg(raw, box, channels=3)

        def other():  # PNG and the like: decode whole, then crop
            return tf.image.crop_to_bounding_box(tf.io.decode_image(raw, channels=3, expand_animations=False),
                                                 box[0], box[1], box[2], box[3])

        img = tf.cond(tf.io.is_jpeg(raw), jpeg, other)
        img = tf.image.resize(img, (size, size), method="bilinear", antialias=True)
        return tf.cond(flip, lambda: tf.image.flip_left_right(img), lambda: img)

    def normalise(images, labels):
        return (images - tf.constant(data.MEAN * 255.0)) / tf.constant(data.STD * 255.0), labels

    keys = tf.data.Dataset.from_generator(batch_keys, output_signature=(
        tf.TensorSpec((), tf.int64), tf.TensorSpec((cfg.batch_size,), tf.int64)))
    # Unbatched for the decode (one image per parallel call), re-batched on the plan's boundaries:
    # the order is deterministic, so batch n holds exactly the plan's batch n.
    return (keys.map(read_tf, num_parallel_calls=autotune).unbatch()
            .map(lambda raw, box, flip, label: (decode_one(raw, box, flip), label), num_parallel_calls=autotune)
            .batch(cfg.batch_size, drop_remainder=True)
            .map(normalise, num_parallel_calls=autotune))


class _Backend:
    """Horovod, MultiWorkerMirroredStrategy, or the default strategy for one process."""

    def __init__(self, tf, cfg: Config, world: World):
        self.tf, self.hvd = tf, None
        if cfg.backend == "horovod":
            if cfg.framework == "keras":
                import horovod.tensorflow.keras as hvd
            else:
                import horovod.tensorflow as hvd
            hvd.init()
            self.hvd = hvd
            self.strategy = tf.distribute.get_strategy()
        elif world.size > 1:
            communication = tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING)
            self.strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=communication)
        else:
            self.strategy = tf.distribute.get_strategy()

    def sum(self, values: list[float]) -> list[float]:
        tf = self.tf
        t = tf.constant(values, dtype=tf.float64)
        if self.hvd:
            t = self.hvd.allreduce(t, op=self.hvd.Sum, name="trainop.report")
        elif self.strategy.num_replicas_in_sync > 1:
            t = self.strategy.reduce(tf.distribute.ReduceOp.SUM, self.strategy.run(lambda: tf.identity(t)), axis=None)
        return [float(v) for v in t.numpy()]

    def save(self, world: World, path, write) -> None:
        """The chief writes `path`. Under MultiWorkerMirroredStrategy saving runs collectives, so
        every worker must save: the others write into a scratch folder that is then removed."""
        if world.is_chief:
            write(path)
        elif self.strategy.num_replicas_in_sync > 1 and not self.hvd:
            with tempfile.TemporaryDirectory() as scratch:
                write(Path(scratch) / Path(path).name)

    def distribute(self, ds):
        tf = self.tf
        if self.hvd:
            ds = ds.prefetch(tf.data.AUTOTUNE)
            # Batches wait on the GPU, not in host memory (the strategy path below does this itself:
            # distribute_datasets_from_function fetches to the replica's device).
            return ds.apply(tf.data.experimental.prefetch_to_device("/gpu:0")) if tf.config.list_logical_devices("GPU") else ds
        # Each worker feeds its own rank's data (no auto-sharding): one replica per worker here.
        return self.strategy.distribute_datasets_from_function(lambda _ctx: ds.prefetch(self.tf.data.AUTOTUNE))


def train(cfg: Config, world: World) -> None:
    if cfg.backend == "native" and world.size > 1:
        os.environ["TF_CONFIG"] = _tf_config(world)
    import tensorflow as tf

    keras = tf.keras
    if not keras.__name__.startswith("tf_keras"):
        raise RuntimeError(f"tf.keras is {keras.__name__}, not tf_keras; run trainer_images/install.sh")
    backend = _Backend(tf, cfg, world)
    if cfg.precision in ("bf16", "fp64"):
        keras.mixed_precision.set_global_policy("mixed_bfloat16" if cfg.precision == "bf16" else "float64")
    tf.keras.utils.set_random_seed(cfg.seed)  # same initial weights everywhere; Horovod broadcasts anyway

    make_dataset, default_steps, bad_samples, plan = _dataset(tf, cfg, world)
    steps = cfg.steps_per_epoch or default_steps
    with backend.strategy.scope():
        model = _model(keras, cfg, horovod=backend.hvd is not None)
        optimizer = keras.optimizers.SGD(learning_rate=cfg.base_lr, momentum=cfg.momentum,
                                         weight_decay=cfg.weight_decay)
    if backend.hvd:
        # Keras: Horovod's wrapper is a new optimizer made from the wrapped one's config (its own
        # slots), so the wrapper is what is built, broadcast, saved and restored below.
        optimizer = backend.hvd.DistributedOptimizer(optimizer) if cfg.framework == "keras" else optimizer
    if cfg.framework == "keras":
        optimizer = _compile(keras, cfg, model, optimizer)
    state = tf.train.Checkpoint(model=model, optimizer=optimizer, step=tf.Variable(0, dtype=tf.int64))
    start = _resume(tf, cfg, world, backend, model, optimizer, state, steps)
    reporter = report.Reporter(cfg.metrics_file, world.size, cfg.batch_size * cfg.scale(world.size), world.is_chief,
                               total_steps=cfg.epochs * steps, report_seconds=cfg.report_seconds,
                               stall_seconds=cfg.stall_seconds, min_step_seconds=cfg.min_step_seconds,
                               events=events.open_writer(cfg.framework, cfg.output_dir) if world.is_chief else None,
                               bad_samples=0 if bad_samples is not None else None)

    def batches(first: int):
        return backend.distribute(make_dataset(first))

    saver = _Saver(cfg, world, backend, state, bad_samples, plan)
    run = _fit if cfg.framework == "keras" else _custom_loop
    loss = run(tf, keras, cfg, world, backend, model, optimizer, batches, start, steps, reporter, saver)
    reporter.final(cfg.epochs, cfg.epochs * steps, loss)
    report.log_digest(world.rank, world.size, report.parameter_digest(w.numpy() for w in model.trainable_weights))
    backend.save(world, cfg.output_dir / "model.keras", model.save)


def _compile(keras, cfg: Config, model, optimizer):
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=cfg.compile)
    return model.optimizer


def _resume(tf, cfg: Config, world: World, backend: _Backend, model, optimizer, state, steps: int) -> int:
    """The global step to start at. Rank 0 restores `state` (model, optimizer slots, step) from
    the checkpoint to resume from; Horovod then broadcasts rank 0's variables and step to every
    rank, which also starts a fresh run alike everywhere (the same seed gives the same weights,
    the broadcast makes sure). The optimizer is built first, so its slots exist to be restored
    and broadcast before the first step (rather than after it, which would let the other ranks'
    first gradients come from un-restored weights)."""
    if backend.hvd or cfg.checkpoint_dir or cfg.resume_from:
        with backend.strategy.scope():
            optimizer.build(model.trainable_variables)
    start = 0
    if world.is_chief:
        path = checkpoint.resolve(cfg.resume_from, cfg.checkpoint_dir)
        if path is not None:
            saved_world, warning = checkpoint.tf_load(path, world.size, state, cfg.elastic)
            start = int(state.step.numpy())
            print(f"trainop_trainer: resuming from {path} at step {start}", file=sys.stderr, flush=True)
            if warning:
                report.write_line(sys.stderr, warning)
            if cfg.elastic and saved_world != world.size:
                report.write_line(sys.stderr, elastic.resume_line(saved_world, cfg.elastic, start, steps))
        elif cfg.resume_from:
            print(f"trainop_trainer: no complete checkpoint under {cfg.checkpoint_dir.parent}; starting at step 0",
                  file=sys.stderr, flush=True)
    if backend.hvd:
        import horovod.tensorflow as hvd_tf  # horovod.tensorflow.keras has neither broadcast below

        start = int(hvd_tf.broadcast_object(start, root_rank=0, name="trainop.resume"))
        hvd_tf.broadcast_variables(model.variables, root_rank=0)
        hvd_tf.broadcast_variables(optimizer.variables(), root_rank=0)
    return start



class _Saver(checkpoint.Saver):
    """Rank 0 writes `state` (checkpoint.tf_save). Horovod keeps the ranks' variables equal, so
    rank 0's are the gang's; the data position is the step."""

    def __init__(self, cfg: Config, world: World, backend: _Backend, state, bad_samples: data.BadSamples | None,
                 plan=None):
        super().__init__(cfg, world)
        self.backend, self.state = backend, state
        self.bad_samples = bad_samples  # checked after every step (_after_step), summed per epoch (_end_epoch)
        # --sample-log (_log_step): the data plan the dataset reads (None: synthetic) and the log
        self.plan = plan
        self.sample_log = elastic.SampleLog(cfg.sample_log, world.rank, world.size) if cfg.sample_log else None

    def sum(self, values: list[float]) -> list[float]:
        return self.backend.sum(values)

    def write(self, step: int, epoch: int):
        if not self.world.is_chief:
            return None
        self.state.step.assign(step)
        return checkpoint.tf_save(self.cfg.checkpoint_dir, step, epoch, self.world.size, self.state, self.cfg.elastic)


def _set_lr(optimizer, cfg: Config, world: World, step: int, steps: int) -> None:
    # The schedule is a function of the global step: a resumed run continues it.
    # An elastic run's peak is scaled by its maximum world, so a resize does not move it.
    optimizer.learning_rate.assign(report.learning_rate(step, steps, cfg.base_lr, cfg.scale(world.size),
                                                        cfg.warmup_epochs))


def _log_step(saver: _Saver, world: World, step: int, epoch: int, step_loss) -> None:
    """--sample-log's line of global step `step` (elastic.SampleLog): the samples the plan gave this
    rank for it (the dataset reads the same plan) and its share of the step's loss."""
    if saver.sample_log is None:
        return
    samples = None
    if saver.plan is not None:
        per_step = getattr(saver.plan, "accumulation", 1)
        samples = [int(i) for n in range((step - 1) * per_step, step * per_step) for i in saver.plan.batch(n)[1]]
    saver.sample_log.step(step, epoch, samples, None if step_loss is None else float(step_loss) / world.size)


def _after_step(saver: _Saver, step: int, epoch: int) -> bool:
    """After each step: too many bad samples on this rank end the run (data.BadSamples.check;
    tf.data's threads only note them); then the saver (True: stopped by SIGTERM, state saved)."""
    if saver.bad_samples is not None:
        saver.bad_samples.check()
    return saver.after_step(step, epoch)


def _end_epoch(cfg, world, backend, model, reporter, epoch, global_step, ran, seconds, local_loss,
               bad_samples: data.BadSamples | None) -> float:
    own_rate = ran * cfg.batch_size * cfg.accumulation / seconds
    # Before the collective, so the other ranks wait for the chief there, outside their timed epoch.
    backend.save(world, cfg.output_dir / f"checkpoint-epoch{epoch}.weights.h5", model.save_weights)
    bad_own = float(bad_samples.count if bad_samples is not None else 0)
    total_rate, loss_total, bad_total = backend.sum([own_rate, local_loss, bad_own])
    if bad_samples is not None:
        reporter.bad_samples = int(bad_total)  # the ranks' shards are disjoint: a sum of distinct files
        bad_samples.check(int(bad_total))  # on every rank alike: the gang's count above the limit
    loss = loss_total / world.size
    reporter.epoch(epoch, global_step, loss, total_rate, ran)
    return loss


def _custom_loop(tf, keras, cfg, world, backend, model, optimizer, batches, start, steps, reporter, saver) -> float:
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    global_batch = cfg.batch_size * world.size
    strategy, hvd = backend.strategy, backend.hvd

    # --compile: XLA compiles the forward and backward pass; collectives stay outside it
    # (Horovod's ops have no XLA kernels here, and the strategy's all-reduce runs in apply_gradients).
    # autograph=False: these steps have no control flow on tensors (their loops and branches are
    # on Python values, unrolled or chosen at tracing), and converting them converts every Keras
    # layer they call too: a tenth of the Python calls of a rank's start (a 2-step run, 2026-12-07:
    # 6.42 -> 5.77 million), at each (re)start of a gang.
    @tf.function(jit_compile=cfg.compile, autograph=False)
    def local_gradients(x, y):
        with tf.GradientTape() as tape:
            per_example = loss_obj(y, model(x, training=True))
            # Native: each replica's share of the global mean, summed across replicas by the strategy.
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=cfg.batch_size if hvd else global_batch)
        return loss, tape.gradient(loss, model.trainable_variables)

    def replica_step(x, y):
        loss, grads = local_gradients(x, y)
        if hvd:
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    accumulation = cfg.accumulation

    def accumulating_step(x, y):
        """An elastic run's step: x stacks `accumulation` micro-batches; their gradients are
        averaged, then all-reduced once (Horovod) and applied. Returns the mean loss."""
        summed, total = None, 0.0
        for a in range(accumulation):  # unrolled into the step's graph
            loss, grads = local_gradients(x[a], y[a])
            summed = grads if summed is None else [s + g for s, g in zip(summed, grads)]
            total += loss
        grads = [g / accumulation for g in summed] if accumulation > 1 else summed
        if hvd:
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return total / accumulation

    @tf.function(autograph=False)
    def train_step(iterator):
        x, y = next(iterator)
        per_replica = strategy.run(accumulating_step if cfg.elastic else replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    iterator = iter(batches(start))
    global_step, loss = start, 0.0
    first_epoch, offset = divmod(start, steps)
    for epoch in range(first_epoch + 1, cfg.epochs + 1):
        began = time.perf_counter()
        loss_sum = tf.constant(0.0, tf.float64 if cfg.precision == "fp64" else tf.float32)
        ran = steps - offset
        first = global_step
        reporter.start_epoch(first)
        for _ in range(ran):
            _set_lr(optimizer, cfg, world, global_step, steps)
            step_loss = train_step(iterator)
            loss_sum += step_loss
            global_step += 1
            _log_step(saver, world, global_step, epoch, step_loss)
            reporter.alive()
            if reporter.due():
                reporter.between(epoch, global_step, float(loss_sum.numpy()) / (global_step - first))  # waits for the device
            if _after_step(saver, global_step, epoch):
                raise SystemExit(143)  # stopped by SIGTERM, state saved
        offset = 0
        local_loss = float(loss_sum.numpy()) / ran  # waits for the device
        loss = _end_epoch(cfg, world, backend, model, reporter, epoch, global_step, ran,
                          time.perf_counter() - began, local_loss, saver.bad_samples)
    return loss


def _fit(tf, keras, cfg, world, backend, model, optimizer, batches, start, steps, reporter, saver) -> float:
    """model.fit from global step `start`. fit cannot begin mid-epoch, so a resume inside an
    epoch first fits that epoch's remaining steps (one call), then the following epochs; each
    call gets a dataset that starts at its own first batch (fit makes a new iterator per call)."""
    state = {"loss": 0.0}
    first_epoch, offset = divmod(start, steps)

    class Trainop(keras.callbacks.Callback):
        def __init__(self, skip: int):
            super().__init__()
            self.skip = skip  # steps of this call's first epoch done before it (a resume mid-epoch)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch, self.began = epoch, time.perf_counter()
            reporter.start_epoch(self.step(0))

        def step(self, batch: int) -> int:
            return self.epoch * steps + self.skip + batch

        def on_train_batch_begin(self, batch, logs=None):
            _set_lr(optimizer, cfg, world, self.step(batch), steps)

        def on_train_batch_end(self, batch, logs=None):
            reporter.alive()
            if reporter.due():  # Keras's loss in `logs`: the epoch's mean so far
                reporter.between(self.epoch + 1, self.step(batch) + 1, float(logs["loss"]))
            # an elastic run's step (_accumulating_model) reports its own loss; without, fit gives
            # only the epoch's running mean: the line has no loss
            _log_step(saver, world, self.step(batch) + 1, self.epoch + 1, logs.get("stepLoss"))
            if _after_step(saver, self.step(batch) + 1, self.epoch + 1):
                raise SystemExit(143)  # stopped by SIGTERM, state saved

        def on_epoch_end(self, epoch, logs=None):
            ran = steps - self.skip
            seconds = time.perf_counter() - self.began
            state["loss"] = _end_epoch(cfg, world, backend, model, reporter, epoch + 1, (epoch + 1) * steps, ran,
                                       seconds, logs["loss"], saver.bad_samples)

    # The variables were broadcast before training (_resume): no BroadcastGlobalVariablesCallback.
    if offset and first_epoch < cfg.epochs:
        model.fit(batches(start), initial_epoch=first_epoch, epochs=first_epoch + 1, steps_per_epoch=steps - offset,
                  callbacks=[Trainop(offset)], verbose=0)
        first_epoch += 1
    if first_epoch < cfg.epochs:
        model.fit(batches(first_epoch * steps), initial_epoch=first_epoch, epochs=cfg.epochs, steps_per_epoch=steps,
                  callbacks=[Trainop(0)], verbose=0)
    return state["loss"]
