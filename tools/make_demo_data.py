#!/usr/bin/env python
"""Write the embedded demo dataset as an ImageFolder tree, so the trainers need no download.

The images are scikit-learn's bundled handwritten digits (1,797 8x8 grey images, 10 classes,
shipped inside the scikit-learn wheel). They are upscaled and saved as PNG files in
OUT/train/<class>/ and OUT/val/<class>/, so the trainers read them through the real
ImageFolder + DataLoader-worker path, exactly as they would read ImageNet.

The split is a fixed shuffle (seed 0). The default val split has 361 images: divisible by
neither 2, 3 nor 4, so distributed evaluation cannot hide padded duplicate samples.

    python tools/make_demo_data.py                      # data/digits, 1,436 train / 361 val
    python tools/make_demo_data.py --out /tmp/d --train-count 64 --val-count 37
"""
import argparse
import json
import os
import sys

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

DEFAULT_VAL = 361


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/digits", help="output directory (default: data/digits)")
    p.add_argument("--size", type=int, default=32, help="side of the written images in pixels (default: 32)")
    p.add_argument("--val-count", type=int, default=DEFAULT_VAL, help=f"val images (default: {DEFAULT_VAL})")
    p.add_argument("--train-count", type=int, default=None,
                   help="train images (default: all that are not in val)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    digits = load_digits()
    images, labels = digits.images, digits.target
    total = len(labels)
    train_count = total - args.val_count if args.train_count is None else args.train_count
    if args.val_count < 1 or train_count < 1 or args.val_count + train_count > total:
        sys.exit(f"error: --train-count + --val-count must be between 2 and {total} (the digits set has {total} images)")
    if args.size < 8:
        sys.exit("error: --size must be at least 8 (the source images are 8x8)")
    params = {"size": args.size, "val_count": args.val_count, "train_count": train_count}
    marker = os.path.join(args.out, "demo.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f) == params:
                print(f"{args.out} already holds this demo set; nothing to do")
                return
    if os.path.exists(os.path.join(args.out, "train")) or os.path.exists(os.path.join(args.out, "val")):
        sys.exit(f"error: {args.out} already holds another dataset: remove it first or pass another --out")

    order = np.random.default_rng(0).permutation(total)
    splits = {"val": order[:args.val_count], "train": order[args.val_count:args.val_count + train_count]}
    for split, indices in splits.items():
        for cls in digits.target_names:
            os.makedirs(os.path.join(args.out, split, str(cls)), exist_ok=True)
        for i in indices:
            # Pixel values are 0..16; stretch to 0..255 and upscale so the usual conv stems have room.
            pixels = (images[i] * (255.0 / 16.0)).round().astype(np.uint8)
            img = Image.fromarray(pixels, mode="L").resize((args.size, args.size), Image.BILINEAR)
            img.save(os.path.join(args.out, split, str(labels[i]), f"{i:04d}.png"))
    with open(marker, "w") as f:  # written last: its presence means the set is complete
        json.dump(params, f)
    print(f"wrote {len(splits['train'])} train and {len(splits['val'])} val images "
          f"({len(digits.target_names)} classes, {args.size}px) to {args.out}")


if __name__ == "__main__":
    main()
