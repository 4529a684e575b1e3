#!/usr/bin/env python
"""Write a copy of an ImageFolder dataset whose images' shorter side is at most --size pixels, once.

Decoding a JPEG costs about its pixel count, and RandomResizedCrop throws most of them away: a copy
at a shorter side of 256-320 px (FFCV's and the DAWNBench entries' lever) is decoded and augmented
faster on every epoch after it is written. Images already at or below --size are copied byte for
byte; larger ones are rescaled (Lanczos) and re-encoded at --quality without chroma subsampling.
docs/input.md cites what the lever costs in accuracy.

    python tools/resize_dataset.py data/imagenet-like data/imagenet-like-288
    python tools/resize_dataset.py /data/imagenet /data/imagenet-288 --size 288 --quality 90
"""
import argparse
import os
import shutil
import sys

from PIL import Image, UnidentifiedImageError


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="dataset directory (ImageFolder layout, e.g. with train/ and val/)")
    p.add_argument("dst", help="output directory (must not exist yet)")
    p.add_argument("--size", type=int, default=288, help="largest shorter side in pixels (default: 288)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of rescaled images (default: 90)")
    p.add_argument("--subsampling", type=int, choices=[0, 1, 2], default=2,
                   help="chroma subsampling of rescaled images: 0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0 (default: 2, "
                        "libjpeg's and OpenCV's default, so what FFCV writes; its chroma decodes 4x faster)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not os.path.isdir(args.src):
        sys.exit(f"error: {args.src} is not a directory: pass an ImageFolder dataset directory")
    if os.path.exists(args.dst):
        sys.exit(f"error: {args.dst} already exists: remove it first or pass another output directory")
    if args.size < 32 or not 1 <= args.quality <= 100:
        sys.exit("error: --size must be at least 32 and --quality between 1 and 100")
    tmp = args.dst.rstrip(os.sep) + ".partial"  # renamed at the end: a finished copy is never half-written
    shutil.rmtree(tmp, ignore_errors=True)
    before = after = count = 0
    for root, _, files in os.walk(args.src):
        out_dir = os.path.join(tmp, os.path.relpath(root, args.src))
        os.makedirs(out_dir, exist_ok=True)
        for name in sorted(files):
            src, dst = os.path.join(root, name), os.path.join(out_dir, name)
            try:
                with Image.open(src) as img:
                    scale = args.size / min(img.size)
                    if scale >= 1 or img.format != "JPEG":
                        shutil.copyfile(src, dst)
                    else:
                        size = (round(img.width * scale), round(img.height * scale))
                        img.convert("RGB").resize(size, Image.LANCZOS).save(dst, "JPEG", quality=args.quality,
                                                                             subsampling=args.subsampling)
            except UnidentifiedImageError:  # not an image (a label file, say): copied as it is
                shutil.copyfile(src, dst)
            except (OSError, SyntaxError, ValueError) as e:  # what PIL raises for a corrupt image
                sys.exit(f"error: cannot read image '{src}' ({e}): replace or delete it, then run this again")
            before, after, count = before + os.path.getsize(src), after + os.path.getsize(dst), count + 1
    os.replace(tmp, args.dst)
    print(f"wrote {count} files to {args.dst}: shorter side <= {args.size} px, {before / 1e6:.1f} MB -> "
          f"{after / 1e6:.1f} MB ({after / max(1, count) / 1000:.1f} KB each)")


if __name__ == "__main__":
    main()
