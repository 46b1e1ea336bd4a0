"""Guest images: recipes, the builder, the kernel and the initramfs.

An image is a directory under ``<data>/images`` (see ``hangar.layout``)
holding an ext4 rootfs made by debootstrap, Debian's cloud kernel, and an
initramfs that loads the virtio drivers and carries the guest's Python files
(agent and init), so that changing the agent never means rebuilding the rootfs.

    recipes     what goes into an image (``Recipe``, ``RECIPES``, ``get_recipe``)
    builder     ``build_image``, ``list_images``, ``resolve_image``
    kernel      fetching and unpacking the kernel .deb
    initramfs   the busybox initramfs and its /init
    commands    running host tools; removing temporary trees safely

Building needs root and the host tools debootstrap, e2fsprogs, kmod, dpkg,
apt and busybox-static.
"""

from hangar.images.builder import (
    KERNEL_CMDLINE,
    GuestImage,
    ImageInfo,
    build_image,
    list_images,
    resolve_image,
)
from hangar.images.recipes import RECIPES, Recipe, get_recipe

__all__ = [
    "KERNEL_CMDLINE",
    "RECIPES",
    "GuestImage",
    "ImageInfo",
    "Recipe",
    "build_image",
    "get_recipe",
    "list_images",
    "resolve_image",
]
