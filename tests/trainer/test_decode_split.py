"""Issue 27: `split` sized from this host's measured rates, and the GPU path's decoder
(`torch_data.DeviceDecoder`: torchvision's nvJPEG, or nvImageCodec where installed and asked for).

CPU-only: the GPU library is replaced by `MockNvImgCodec`, a stand-in for nvImageCodec's Python
module (named as such) that decodes on the CPU, so the decoder's own logic (batched call, the
CPU fallback for images the library refuses, the decode parameters that keep the contract) runs
here; the real library's output is compared with the CPU path on the GPU machine
(test_pipeline.py's CUDA test and bench/gpu_decode_probe.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision

from trainop_trainer import data, torch_data

pytestmark = pytest.mark.trainer

SIZE = 32


# ---- cpu_share: the CPU takes what its workers keep up with, the device the rest ----

def test_split_gives_the_cpu_what_its_workers_keep_up_with():
    # 15 workers at 380 images/s (5,700/s) feed a model that trains at 3,900/s: all on the CPU
    assert torch_data.cpu_share("split", 15, 380.0, 3900.0) == 1.0
    # 7 workers (8 cores per GPU) make 2,660/s: the CPU takes 2,660/3,900 of each batch
    assert torch_data.cpu_share("split", 7, 380.0, 3900.0) == pytest.approx(2660 / 3900)
    # a faster GPU (or slower cores) moves work to the device
    assert torch_data.cpu_share("split", 11, 380.0, 4600.0) < torch_data.cpu_share("split", 11, 380.0, 3900.0)
    assert torch_data.cpu_share("split", 11, 300.0, 3900.0) < torch_data.cpu_share("split", 11, 380.0, 3900.0)


def test_fewer_cores_per_gpu_move_work_to_the_gpu():
    shares = [torch_data.cpu_share("split", w, 380.0, 3900.0) for w in (15, 11, 7, 3, 1)]
    assert shares == sorted(shares, reverse=True) and shares[0] == 1.0 and 0 < shares[-1] < 0.2


def test_split_without_rates_stays_on_the_cpu_and_the_fixed_paths_ignore_rates():
    assert torch_data.cpu_share("split", 4) == 1.0  # no measurement (a CPU device): nothing of the device
    assert torch_data.cpu_share("split", 4, 380.0, 0.0) == 1.0
    assert torch_data.cpu_share("cpu", 1, 1.0, 1e6) == 1.0
    assert torch_data.cpu_share("gpu", 60, 1e6, 1.0) == 0.0


# ---- the start-up measurements ----

def test_worker_rate_is_measured_in_forked_workers_on_the_ranks_own_images(image_tars):
    ds = data.scan(image_tars)
    plan = data.BatchPlan(tuple(ds.blocks(0, 1, "sequential")), 8, 42, 0)
    reader = torch_data.BatchReader(ds.samples, SIZE, 42, 0, pool=plan.pool)
    forked = torch_data.measure_worker_rate(reader, plan, SIZE, workers=2, images=6)
    alone = torch_data.measure_worker_rate(reader, plan, SIZE, workers=0, images=6)
    # tiny 48-px JPEGs decode in well under a millisecond; a rate, not a time or a count
    for rate in (forked, alone):
        assert np.isfinite(rate) and rate > 100
    assert torch_data._RATE_PICKS == []  # the measured images are not kept in the rank's process


def test_appetite_times_the_model_and_leaves_it_as_it_was():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    rate = torch_data.measure_appetite(model, 4, SIZE, torch.device("cpu"), torch.contiguous_format, "fp32", steps=1)
    assert rate > 0
    after = model.state_dict()
    # parameters and batch-norm statistics (a training-mode forward updates them) come back
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters()) and not model.training


def test_the_loader_sizes_split_from_the_measured_rates(image_tars, monkeypatch):
    ds = data.scan(image_tars)
    monkeypatch.setattr(torch_data, "measure_worker_rate", lambda *a, **k: 250.0)
    loader = torch_data.Loader(ds, 0, 1, 8, SIZE, 42, 2, "split", "sequential", torch.device("cpu"), appetite=1000.0)
    assert loader.rates == (250.0, 1000.0) and loader.cpu_count == 4  # 2 x 250 of 1,000: half of 8
    no_appetite = torch_data.Loader(ds, 0, 1, 8, SIZE, 42, 2, "split", "sequential", torch.device("cpu"))
    assert no_appetite.rates is None and no_appetite.cpu_count == 8


# ---- DeviceDecoder ----

class MockNvImgCodec:
    """Stand-in for `nvidia.nvimgcodec` (GPU library; none here): the calls DeviceDecoder makes,
    decoding on the CPU into HWC uint8 arrays as the library returns them. Refuses images whose
    first bytes are in `refuse`, as the library answers None for what no backend decodes."""

    class BackendKind:
        HW_GPU_ONLY, GPU_ONLY, CPU_ONLY = "hw", "gpu", "cpu"

    class ColorSpec:
        SRGB = "srgb"

    class SampleFormat:
        I_RGB = "i_rgb"

    def __init__(self, refuse=()):
        self.refuse, self.calls, self.decoders = set(refuse), [], []

    def Backend(self, kind):  # noqa: N802 (the library's name)
        return kind

    def DecodeParams(self, **kwargs):  # noqa: N802
        return kwargs

    def CodeStream(self, array):  # noqa: N802
        return bytes(array)

    def Decoder(self, **kwargs):  # noqa: N802
        self.decoders.append(kwargs)
        mock = self

        class _Decoder:
            def decode(self, streams, params=None, cuda_stream=0):
                mock.calls.append((len(streams), params, cuda_stream))
                out = []
                for raw in streams:
                    if raw[:8] in mock.refuse:
                        out.append(None)
                        continue
                    image = torchvision.io.decode_image(torch.frombuffer(bytearray(raw), dtype=torch.uint8),
                                                        mode=torchvision.io.ImageReadMode.RGB)
                    out.append(image.permute(1, 2, 0).numpy().copy())  # HWC, as the library's Image
                return out

        return _Decoder()


def _encoded_batch(dataset):
    reader = torch_data.BatchReader(dataset.samples, SIZE, 7, 0)
    indices = np.arange(len(dataset.samples))
    images, encoded, offsets, boxes, flips, _, _ = reader[(0, indices, 0)]
    cpu_images, *_ = reader[(0, indices, len(indices))]
    return encoded, offsets, boxes, flips, torch_data.finish_uint8(cpu_images, torch.channels_last)


def test_device_decoder_decodes_a_batch_in_one_call_and_keeps_the_contract(image_folder):
    dataset = data.scan(image_folder)
    encoded, offsets, boxes, flips, cpu = _encoded_batch(dataset)
    codec = MockNvImgCodec()
    decoder = torch_data.DeviceDecoder(torch.device("cpu"), "nvimgcodec", codec_module=codec)
    assert decoder.name == "nvimgcodec"
    # hardware engines first, then nvJPEG's CUDA decoder, then the CPU; few threads in the rank's process
    assert codec.decoders[0]["backends"] == ["hw", "gpu", "cpu"] and codec.decoders[0]["max_num_cpu_threads"] <= 2
    out = torch_data.decode_batch(encoded, offsets, boxes, flips, SIZE, torch.device("cpu"), torch.channels_last,
                                  decoder)
    assert [n for n, _, _ in codec.calls] == [len(dataset.samples)]  # one batched call
    # as the CPU path: no EXIF rotation (torchvision's decode applies none), RGB interleaved
    assert codec.calls[0][1] == {"apply_exif_orientation": False, "color_spec": "srgb", "sample_format": "i_rgb"}
    assert out.shape == cpu.shape and out.is_contiguous(memory_format=torch.channels_last)
    assert float((out - cpu).abs().mean(dim=(1, 2, 3)).max()) < 0.1
    assert decoder.refused == 0


def test_images_the_device_decoder_refuses_are_decoded_on_the_cpu(image_folder):
    dataset = data.scan(image_folder)
    encoded, offsets, boxes, flips, cpu = _encoded_batch(dataset)
    first = bytes(encoded[int(offsets[0]):int(offsets[0]) + 8].numpy())
    codec = MockNvImgCodec(refuse={first})
    decoder = torch_data.DeviceDecoder(torch.device("cpu"), "nvimgcodec", codec_module=codec)
    out = torch_data.decode_batch(encoded, offsets, boxes, flips, SIZE, torch.device("cpu"), torch.channels_last,
                                  decoder)
    assert decoder.refused >= 1  # at least the first (JPEGs of one encoder may share their first bytes)
    assert float((out - cpu).abs().mean(dim=(1, 2, 3)).max()) < 0.1  # the refused ones too, decoded by the CPU


def test_the_decoder_choice(monkeypatch):
    monkeypatch.delenv("TRAINOP_DEVICE_DECODER", raising=False)
    # the default is torchvision's nvJPEG (measured no slower): nvImageCodec is not even imported
    monkeypatch.setattr(torch_data, "_nvimgcodec", lambda: pytest.fail("imported"))
    assert torch_data.DeviceDecoder(torch.device("cpu")).name == "cpu"
    monkeypatch.setattr(torch_data, "_nvimgcodec", lambda: None)  # not installed
    with pytest.raises(RuntimeError, match="nvimgcodec"):
        torch_data.DeviceDecoder(torch.device("cpu"), "nvimgcodec")
    monkeypatch.setenv("TRAINOP_DEVICE_DECODER", "nvimgcodec")
    with pytest.raises(RuntimeError, match="not installed"):
        torch_data.DeviceDecoder(torch.device("cpu"))
    # nvjpeg asked for: the library is not even imported
    monkeypatch.setattr(torch_data, "_nvimgcodec", lambda: pytest.fail("imported"))
    assert torch_data.DeviceDecoder(torch.device("cpu"), "nvjpeg").name == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available() or torch_data._nvimgcodec() is None,
                    reason="CUDA-only part: nvImageCodec on a GPU (none here)")
def test_nvimgcodec_on_the_gpu_follows_the_contract(image_folder):
    dataset = data.scan(image_folder)
    encoded, offsets, boxes, flips, cpu = _encoded_batch(dataset)
    device = torch.device("cuda")
    decoder = torch_data.DeviceDecoder(device, "nvimgcodec")
    out = torch_data.decode_batch(encoded, offsets, boxes, flips, SIZE, device, torch.channels_last, decoder)
    assert out.is_cuda and float((out.cpu() - cpu).abs().mean(dim=(1, 2, 3)).max()) < 0.1
