"""The training transform's cost per CPU core, backend by backend, on the same JPEGs in one run.

Decoding and augmenting JPEGs is CPU work whose cost per core is the same on a GPU node as anywhere,
so it can be measured here and turned into the cores one GPU needs. Every backend row runs in this
one process, pinned to one core (os.sched_setaffinity) with one torch thread (and one DALI thread),
over the same images, interleaved over --rounds, so the rows are side by side; each row's rate is
images per second of the process's CPU time (all threads): the median of its rounds, and their range.
Then a sweep over the default loader's worker count (all cores, wall time) shows where its throughput
peaks.

Rows (each per image: read the file, decode, RandomResizedCrop 224 with scale (0.08, 1), random
horizontal flip; what else each includes is said in its row):
  today            PIL (ImageFolder's pil_loader) + torchvision transforms, ToTensor and Normalize:
                   a float32 CHW tensor, as every trainer's build_datasets made it before --decoder
  default          the trainers' own train set (distributed.py's build_datasets and load_image, so this
                   row follows them) with their default decoder, which the row names: TorchCodec's
                   decode_image where it imports, after PIL's header check, transforms v2 on uint8: a
                   uint8 CHW tensor ('default resized': the same on --resized)
  default --decoder torchvision  the same with torchvision.io's decode_image (the default before TorchCodec)
  default --decoder pil  the same with PIL decoding, transforms v2 on PIL images
  tc-decode        torchcodec.decoders.decode_jpeg on the file + transforms v2 on the uint8 tensor
  tv-decode        torchvision.io.decode_jpeg on the file's bytes + transforms v2 on the uint8 tensor:
                   a uint8 CHW tensor, normalisation left to the device (row 'normalise' prices it on a CPU)
  tv-decode resized  the same on the copy written by tools/resize_dataset.py (--resized)
  pil-draft        PIL decoding at a reduced scale where the crop allows (Image.draft)
  dali-cpu         NVIDIA DALI, fused decode-and-random-crop on the CPU (decoders.image_random_crop),
                   resize to 224, mirror: uint8 CHW, no normalisation (as tv-decode)
  normalise        uint8 -> float32, /255, mean/std on the CPU: what 'today' pays on top of the others
  GPU rows (CUDA only): dali-mixed (nvJPEG, device="mixed"), tv-decode-cuda and torchcodec-cuda
                   (decode_jpeg(device="cuda") of torchvision.io and of TorchCodec on batches of 32,
                   transforms v2 on the GPU), uint8 on the GPU. Their 'images/s per core' is images per
                   CPU-second spent driving the GPU; their wall images/s is what that one core and the GPU
                   deliver together (not the GPU's own peak: one Python thread launches every kernel)

    python tools/make_imagenet_like.py && python tools/resize_dataset.py data/imagenet-like data/imagenet-like-288
    python benchmarks/input_pipeline.py --data data/imagenet-like --resized data/imagenet-like-288
"""
import argparse
import glob
import importlib.util
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision import datasets, io, transforms
from torchvision.transforms import v2

A100_IMAGES_PER_SEC = 2470  # NVIDIA DeepLearningExamples ResNet-50, one A100, AMP
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/imagenet-like", help="ImageFolder dataset (its train/ is read)")
    p.add_argument("--resized", default=None, help="its copy by tools/resize_dataset.py (adds the resized row)")
    p.add_argument("--images", type=int, default=500, help="images per row and round (default: 500)")
    p.add_argument("--rounds", type=int, default=5, help="rounds over the rows: each row's median and range of them "
                   "(default: 5)")
    p.add_argument("--max-workers", type=int, default=4, help="worker sweep: 0 .. this many (default: 4)")
    p.add_argument("--sweep-images", type=int, default=640, help="images per worker count (default: 640)")
    return p.parse_args(argv)


def jpeg_files(root, count):
    files = sorted(glob.glob(os.path.join(root, "train", "*", "*")))
    if not files:
        sys.exit(f"error: no images in {root}/train/<class>/: run python tools/make_imagenet_like.py first")
    return files[:count]


def timed(fn, files, warmup=32):
    """Images per CPU-second of fn over files (this process's CPU time, all its threads), and per second of
    wall time, after fn warms up on the first `warmup` of them. Pinned to one core, the first is its images/s
    per core, and unlike wall time it does not count the time other processes of a shared machine hold that
    core; the second is what a GPU row delivers, its GPU's time included."""
    fn(files[:warmup])
    start, wall = time.process_time(), time.perf_counter()
    fn(files)
    return len(files) / (time.process_time() - start), len(files) / (time.perf_counter() - wall)


def run_today(files):
    tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    for path in files:
        tf(datasets.folder.pil_loader(path))


TV_TRANSFORM = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])


def run_tv_decode(files):
    for path in files:
        TV_TRANSFORM(io.decode_jpeg(io.read_file(path), mode=io.ImageReadMode.RGB))


def torchcodec_decoders():
    """(TorchCodec's decoders module, None), or (None, why its rows cannot run): not installed, or installed but not
    loading with this torch (a build for another torch fails as its libraries load)."""
    if not importlib.util.find_spec("torchcodec"):
        return None, "TorchCodec not installed: pip install torchcodec (scripts/fetch_wheels.sh fetches it)"
    try:
        from torchcodec import decoders
        return decoders, None
    except (ImportError, OSError, RuntimeError) as e:
        return None, f"TorchCodec does not load with torch {torch.__version__}: {str(e).strip().splitlines()[0]}"


def run_tc_decode(decoders):
    def run(files):
        for path in files:
            TV_TRANSFORM(decoders.decode_jpeg(path, mode="RGB"))
    return run


def run_default(root, *flags):
    """A runner over the trainers' own train set of root (their default flags, then flags), and the decoder it uses
    (build_datasets fills in the default's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import distributed
    args = distributed.argument_parser().parse_args(["--data", root, *flags])
    train_set = distributed.build_datasets(args)[0]
    index = {os.path.abspath(path): i for i, (path, _) in enumerate(train_set.samples)}

    def run(files):
        for path in files:
            train_set[index[os.path.abspath(path)]]
    return run, args.decoder


def run_pil_draft(files):
    """RandomResizedCrop's box drawn on the full size (from the JPEG header), then decoded at the
    smallest 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling, PIL's Image.draft) that still gives the
    box at least 224 px: the decoder skips most of the work for large crops, as DALI's ROI decode does."""
    for path in files:
        with Image.open(path) as img:
            top, left, height, width = v2.RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3])
            full = img.size
            img.draft("RGB", (full[0] * 224 // width, full[1] * 224 // height))
            sx, sy = img.size[0] / full[0], img.size[1] / full[1]
            box = (left * sx, top * sy, (left + width) * sx, (top + height) * sy)
            img = img.convert("RGB").resize((224, 224), Image.BILINEAR, box=box, reducing_gap=None)
        if torch.rand(1) < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        torch.from_numpy(np.array(img)).permute(2, 0, 1)


def run_normalise(files):
    normalise = v2.Normalize(MEAN, STD)
    image = torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8)
    for _ in files:
        normalise(image.float().div_(255))


def dali_pipeline(files, device, batch_size=32):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch_size, num_threads=1, device_id=0 if device == "mixed" else None,
                  prefetch_queue_depth=1)
    def pipe():
        jpegs, labels = fn.readers.file(files=files, labels=[0] * len(files), name="r")
        images = fn.decoders.image_random_crop(jpegs, device=device, output_type=types.RGB,
                                               random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
        images = fn.resize(images, resize_x=224, resize_y=224)
        return fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW",
                                        mirror=fn.random.coin_flip()), labels

    built = pipe()
    built.build()
    return built


def run_dali(device, all_files):
    """A runner whose pipeline over all_files is built in its warm-up call (after the process is pinned:
    DALI's threads inherit the core), not while timed; each call runs len(files) images' worth of batches."""
    pipe = None

    def run(files):
        nonlocal pipe
        pipe = pipe or dali_pipeline(all_files, device)
        for _ in range(-(-len(files) // pipe.max_batch_size)):
            out, _ = pipe.run()
        if device == "mixed":
            out.as_cpu()  # waits for the GPU work of the last batch, and so of every batch before it
    return run


def run_tv_decode_cuda(files):
    for i in range(0, len(files), 32):
        batch = io.decode_jpeg([io.read_file(p) for p in files[i:i + 32]], mode=io.ImageReadMode.RGB, device="cuda")
        for image in batch:
            TV_TRANSFORM(image)
    torch.cuda.synchronize()


def tc_cuda_unavailable(decoders, files):
    """Why TorchCodec cannot decode on this GPU, or None: its Linux wheels on PyPI are CUDA builds with nvJPEG (0.14
    on), but a CPU-only build (download.pytorch.org/whl/cpu, or one from source) raises at its first CUDA decode."""
    try:
        decoders.decode_jpeg(files[:1], mode="RGB", device="cuda")
    except RuntimeError as e:
        return f"TorchCodec's CUDA decoder fails: {str(e).strip().splitlines()[0]}"
    return None


def run_tc_decode_cuda(decoders):
    """nvJPEG through TorchCodec: a list of files is one batched decode (its decode_jpeg reads the files on the CPU,
    decodes on the current CUDA stream), then transforms v2 crop and flip each image on the GPU."""
    def run(files):
        for i in range(0, len(files), 32):
            for image in decoders.decode_jpeg(files[i:i + 32], mode="RGB", device="cuda"):
                TV_TRANSFORM(image)
        torch.cuda.synchronize()  # the decodes and transforms were queued on the current stream
    return run


def worker_sweep(root, count, max_workers):
    tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    dataset = torch.utils.data.Subset(datasets.ImageFolder(os.path.join(root, "train"), tf), range(count))
    rates = []
    for workers in range(max_workers + 1):
        loader = torch.utils.data.DataLoader(dataset, batch_size=32, num_workers=workers, shuffle=True)
        start = time.perf_counter()
        for _ in loader:
            pass
        rates.append(len(dataset) // 32 * 32 / (time.perf_counter() - start))
    return rates


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")  # the sweep passes the cores on purpose
    files = jpeg_files(args.data, args.images)
    all_cores = os.sched_getaffinity(0)
    torch.set_num_threads(1)
    # One core, before any row starts a thread (CUDA's, in the torchcodec-cuda probe): every thread shares it.
    os.sched_setaffinity(0, {min(all_cores)})
    codec, no_codec = torchcodec_decoders()
    default, decoder = run_default(args.data)
    rows = [("today", "PIL + transforms, float32 normalised", run_today, files),
            ("default", f"the trainers' default, --decoder {decoder}: uint8", default, files),
            ("default --decoder torchvision", "torchvision.io's decode_image, uint8",
             run_default(args.data, "--decoder", "torchvision")[0], files),
            ("default --decoder pil", "the trainers' --decoder pil, uint8",
             run_default(args.data, "--decoder", "pil")[0], files),
            ("tc-decode", "torchcodec decode_jpeg + v2, uint8", no_codec or run_tc_decode(codec), files),
            ("tv-decode", "torchvision.io decode_jpeg + v2, uint8", run_tv_decode, files),
            ("pil-draft", "PIL reduced-scale decode of the crop, uint8", run_pil_draft, files)]
    if args.resized:
        resized = jpeg_files(args.resized, args.images)
        rows += [("default resized", "the trainers' default on --resized", run_default(args.resized)[0], resized),
                 ("tv-decode resized", "tv-decode on --resized", run_tv_decode, resized),
                 ("pil-draft resized", "pil-draft on --resized", run_pil_draft, resized)]
    try:
        import nvidia.dali  # noqa: F401  (only to know whether the DALI rows can run)
        dali = None
    except ImportError:
        dali = "DALI not installed: pip install -c requirements.txt nvidia-dali-cuda130"
    rows.append(("dali-cpu", "DALI CPU decode+crop, uint8", dali or run_dali("cpu", files), files))
    rows.append(("normalise", "uint8 -> normalised float32 only", run_normalise, files))
    gpu = None if torch.cuda.is_available() else "no CUDA device"
    rows.append(("dali-mixed", "DALI nvJPEG (GPU), uint8 on GPU", gpu or dali or run_dali("mixed", files), files))
    rows.append(("tv-decode-cuda", "torchvision.io decode_jpeg(cuda) + v2 on GPU", gpu or run_tv_decode_cuda, files))
    rows.append(("torchcodec-cuda", "TorchCodec decode_jpeg(cuda), nvJPEG, + v2 on GPU",
                 no_codec or gpu or tc_cuda_unavailable(codec, files) or run_tc_decode_cuda(codec), files))

    print(f"{len(files)} images of {args.data}/train per row, one process pinned to core {min(all_cores)}, "
          f"1 thread, {args.rounds} rounds; A100 rate {A100_IMAGES_PER_SEC} images/s (NVIDIA DeepLearningExamples "
          "RN50 AMP)")
    print("| backend | what it includes | images/s per core, median (range) | CPU ms per image | wall images/s | "
          "x today | cores per A100 |\n|---|---|---|---|---|---|---|")
    # Rounds interleave the rows: on a shared machine, another process taking the core for a while then slows one
    # round of every row, not one row, and the median leaves that round out.
    runnable = [(name, run, row_files) for name, _, run, row_files in rows if not isinstance(run, str)]
    cpu, wall = ({name: [] for name, _, _ in runnable} for _ in range(2))
    notices = {}  # each warning a row raised (torchvision.io's that TorchCodec supersedes it): the rows that raised it
    # Recorded, to be shown once after the table: "once" would not hold, TorchCodec's decoders change the warning
    # filters at every call, which clears the registry of what was shown; "default" also shows the DeprecationWarnings
    # that Python hides when raised outside __main__.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(args.rounds):
            for name, run, row_files in runnable:
                rate, wall_rate = timed(run, row_files)
                cpu[name].append(rate)
                wall[name].append(wall_rate)
                for warning in caught:
                    names = notices.setdefault(f"{warning.category.__name__}: {warning.message}", [])
                    if name not in names:
                        names.append(name)
                caught.clear()
    for name, what, run, _ in rows:
        if isinstance(run, str):
            print(f"| {name} | {what} | skipped: {run} | | | | |")
            continue
        rate = statistics.median(cpu[name])
        print(f"| {name} | {what} | {rate:.0f} ({min(cpu[name]):.0f}-{max(cpu[name]):.0f}) | {1000 / rate:.2f} | "
              f"{statistics.median(wall[name]):.0f} | {rate / statistics.median(cpu['today']):.2f} | "
              f"{A100_IMAGES_PER_SEC / rate:.1f} |")
    # The rows of a round ran one after the other: their ratio, round by round, is the least disturbed comparison.
    ratios = [a / b for a, b in zip(cpu["default"], cpu["default --decoder torchvision"])]
    print(f"\ndefault (--decoder {decoder}) / default --decoder torchvision, per core, round by round: median "
          f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")
    for text, names in notices.items():
        print(f"\nwarned by {', '.join(names)}: {text}")
    os.sched_setaffinity(0, all_cores)

    rates = worker_sweep(args.data, args.sweep_images, args.max_workers)
    print(f"\nDefault loader (today's transform, DataLoader batch 32, {os.cpu_count()} cores), images/s by -j:")
    print("| -j | " + " | ".join(map(str, range(len(rates)))) + " |\n" + "|---" * (len(rates) + 1) + "|")
    print("| images/s | " + " | ".join(f"{r:.0f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
