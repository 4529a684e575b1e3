#!/usr/bin/env python
"""Write an ImageNet-like JPEG set (ImageFolder layout) from real photographs, for input-pipeline benchmarks.

The demo digits cost nothing to decode; ImageNet's JPEGs do, and that cost is what limits GPU runs. This
tool cuts real photographs (scikit-learn's bundled china.jpg and flower.jpg, 640x427, shipped inside
the scikit-learn wheel: nothing is downloaded) into JPEGs whose pixel counts, aspect ratios and
encoding match ImageNet's training set, so decoding them costs what decoding ImageNet costs:

- size: about 400x350 on average (tensorpack's "Efficient DataFlow" notes on ILSVRC12: "the average
  resolution is 400x350"); the shorter side is drawn from N(320, 45) clipped to [200, 500] and the
  aspect ratio from ImageNet's usual camera shapes (4:3 and 3:2, landscape 3 times in 4, some square);
- bytes: about 110 KB each (ILSVRC12's train set: 1.28 M images in about 140 GB);
- encoding: baseline JPEG at quality 96 without chroma subsampling (PIL subsampling=0, i.e. 4:4:4), the
  most common setting found by analyses of ImageNet's JPEG quantisation tables.

Each image is a random crop (8-100 % of the photo's area, in the target aspect) of one photo, rescaled
to the target size, maybe mirrored, with colour jitter (brightness, contrast, saturation) and
sharpening. These are real photographs' statistics, not random noise, whose JPEGs would decode (and
compress) quite differently. Class k draws from photo k % 2 with its own colour cast, so the classes
are learnable. Deterministic: image i of a split depends only on (--seed, split, i).

    python tools/make_imagenet_like.py                               # data/imagenet-like: 2000 train, 200 val
    python tools/make_imagenet_like.py --out /tmp/i --train-count 20 --val-count 10 --classes 2

-j N writes the images in N processes (default: one per core); the files are the same at any N.

--distinct N writes only the first N images of each split; image i >= N is a hard link to image i % N (the same
bytes, no inode, only a directory entry). A tree of ImageNet's shape then takes 122 MB, not 140 GB, for what
scales with the number of files (listing the tree, the file table, loader start-up: benchmarks/imagenet_scale.py),
not for accuracy:

    python tools/make_imagenet_like.py --out /tmp/imagenet-scale --classes 1000 --train-count 1281000 \
        --val-count 50000 --distinct 256                         # ImageNet's 1,331,000 files, 122 MB, 2 minutes
"""
import argparse
import json
import multiprocessing
import os
import sys

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter
from sklearn.datasets import load_sample_images

ASPECTS = [(4 / 3, 0.45), (3 / 2, 0.22), (3 / 4, 0.17), (2 / 3, 0.08), (1.0, 0.08)]  # width / height, share


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/imagenet-like", help="output directory (default: data/imagenet-like)")
    p.add_argument("--train-count", type=int, default=2000, help="train images (default: 2000)")
    p.add_argument("--val-count", type=int, default=200, help="val images (default: 200)")
    p.add_argument("--classes", type=int, default=10, help="class folders (default: 10)")
    p.add_argument("--quality", type=int, default=96, help="JPEG quality, 4:4:4 (default: 96, ImageNet's usual)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random choice (default: 0)")
    p.add_argument("--distinct", type=int, default=0, metavar="N",
                   help="write N images per split, the rest as hard links to them (default: 0, every image written)")
    p.add_argument("-j", "--jobs", type=int, default=len(os.sched_getaffinity(0)),
                   help="processes writing images (default: one per core)")
    return p.parse_args(argv)


def target_size(rng):
    short = float(np.clip(rng.normal(320, 45), 200, 500))
    aspect = ASPECTS[rng.choice(len(ASPECTS), p=[share for _, share in ASPECTS])][0]
    return (round(short * aspect), round(short)) if aspect >= 1 else (round(short), round(short / aspect))


def make_image(photos, cls, classes, rng):
    """One ImageNet-sized image of class cls: a jittered crop of photo cls % 2, rescaled."""
    photo = photos[cls % len(photos)]
    width, height = target_size(rng)
    aspect = width / height
    area = rng.uniform(0.08, 1.0) * photo.width * photo.height
    crop_w = min(photo.width, round((area * aspect) ** 0.5))
    crop_h = min(photo.height, round(crop_w / aspect))
    crop_w = min(crop_w, round(crop_h * aspect))
    left, top = rng.integers(0, photo.width - crop_w + 1), rng.integers(0, photo.height - crop_h + 1)
    img = photo.resize((width, height), Image.BICUBIC, box=(left, top, left + crop_w, top + crop_h))
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    # The class's colour cast: a fixed per-channel gain, so classes differ in more than the photo.
    gains = 0.75 + 0.5 * np.random.default_rng(cls).random(3)
    img = Image.fromarray(np.clip(np.asarray(img, np.float32) * gains, 0, 255).astype(np.uint8))
    for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        img = enhance(img).enhance(rng.uniform(0.7, 1.3))
    # Upscaled crops are softer than camera images (and compress better): sharpen them back.
    return img.filter(ImageFilter.UnsharpMask(radius=2, percent=int(rng.integers(60, 160)), threshold=2))


PHOTOS = []  # the two photographs, loaded once per process


def load_photos():
    PHOTOS[:] = [Image.fromarray(image) for image in load_sample_images().images]


def image_path(out, split, i, classes):
    return os.path.join(out, split, f"class{i % classes:02d}", f"{split}_{i:06d}.JPEG")


def write_image(task):
    """Image i of a split, written; its (width, height, bytes)."""
    out, split, split_id, i, classes, quality, seed = task
    rng = np.random.default_rng([seed, split_id, i])
    cls = i % classes
    img = make_image(PHOTOS, cls, classes, rng)
    path = image_path(out, split, i, classes)
    img.save(path, "JPEG", quality=quality, subsampling=0)
    return img.width, img.height, os.path.getsize(path)


def main(argv=None):
    args = parse_args(argv)
    if args.train_count < args.classes or args.val_count < 1 or args.classes < 1:
        sys.exit("error: --classes must be at least 1, --train-count at least --classes and --val-count at least 1")
    if not 1 <= args.quality <= 100:
        sys.exit("error: --quality must be between 1 and 100")
    if args.jobs < 1:
        sys.exit("error: --jobs must be at least 1")
    if args.distinct < 0:
        sys.exit("error: --distinct must be at least 0")
    params = {k: getattr(args, k) for k in ("train_count", "val_count", "classes", "quality", "seed")}
    if args.distinct:  # only then: the markers of sets written before --distinct existed stay valid
        params["distinct"] = args.distinct
    marker = os.path.join(args.out, "imagenet-like.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f)["params"] == params:
                print(f"{args.out} already holds this set; nothing to do")
                return
    if os.path.exists(os.path.join(args.out, "train")) or os.path.exists(os.path.join(args.out, "val")):
        sys.exit(f"error: {args.out} already holds another dataset: remove it first or pass another --out")

    tasks, splits = [], []
    for split_id, (split, count) in enumerate((("train", args.train_count), ("val", args.val_count))):
        for cls in range(args.classes):
            os.makedirs(os.path.join(args.out, split, f"class{cls:02d}"), exist_ok=True)
        distinct = min(count, args.distinct or count)
        tasks += [(args.out, split, split_id, i, args.classes, args.quality, args.seed) for i in range(distinct)]
        splits.append((split, distinct, count))
    if args.jobs > 1:
        with multiprocessing.Pool(args.jobs, initializer=load_photos) as pool:
            written = pool.map(write_image, tasks, chunksize=16)
    else:
        load_photos()
        written = list(map(write_image, tasks))
    for split, distinct, count in splits:  # here, not in the pool: a link is one system call, not worth a message
        for i in range(distinct, count):
            os.link(image_path(args.out, split, i % distinct, args.classes),
                    image_path(args.out, split, i, args.classes))
    widths, heights, sizes = zip(*written)
    stats = {"mean_width": round(float(np.mean(widths)), 1), "mean_height": round(float(np.mean(heights)), 1),
             "mean_kb": round(float(np.mean(sizes)) / 1000, 1), "quality": args.quality, "subsampling": "4:4:4"}
    with open(marker, "w") as f:  # written last: its presence means the set is complete
        json.dump({"params": params, "stats": stats}, f)
    linked = args.train_count + args.val_count - len(tasks)
    distinct = f", {len(tasks)} distinct, {linked} hard links to them" if linked else ""
    print(f"wrote {args.train_count} train and {args.val_count} val JPEGs ({args.classes} classes{distinct}) to "
          f"{args.out}: mean {stats['mean_width']:.0f}x{stats['mean_height']:.0f} px, {stats['mean_kb']:.1f} KB, "
          f"quality {args.quality}, 4:4:4 (ImageNet: about 400x350, 110 KB, quality 96, 4:4:4)")


if __name__ == "__main__":
    main()
