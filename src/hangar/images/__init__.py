"""Guest images: recipes, the builder, the kernel and the initramfs.

An image build is a directory under ``<data>/images`` (see ``hangar.layout``)
holding an ext4 rootfs made by debootstrap, Debian's cloud kernel (bzImage
and ELF), and an initramfs that loads the virtio drivers and carries the
guest's Python files (agent and init), so that changing the agent never
means rebuilding the rootfs. A build never changes once made; its id,
``<name>-<digest>``, covers its bytes.

    recipes     what goes into an image (``Recipe``, ``RECIPES``, ``get_recipe``)
    guest_image a built image as a VMM sees it (``GuestImage``, ``image_id``)
    builder     ``build_image``: a recipe's build, step by step (``finish_build`` packs, names)
    catalogue   the builds on disk: ``list_images``, ``resolve_image``, ``resolve_pinned``
    debian      debootstrap from the host's mirror, apt-get install in the tree
    rootfs      shaping a guest's tree (``guest_setup``, ``trim``, ``put_file``)
    packing     mkfs.ext4 of the tree (``pack``), the hash of a build's bytes
    gc          ``collect``: removing builds nothing pins or uses
    kernel      fetching and unpacking the kernel .deb
    vmlinux     the ELF kernel from the bzImage (``ensure_vmlinux``)
    initramfs   the busybox initramfs and its /init
    commands    running host tools; removing temporary trees safely
    template_file, template_builder   users' templates (TOML) and their builds
    oci, oci_check   OCI archives: checked member by member, then unpacked (umoci)
    runtime     the Python runtime added to OCI images
    safetree    files inside a tree an image shaped, never leaving it (dir fds, O_NOFOLLOW)
    confined, buildns   template steps and packages in a build namespace, never host root
    staging     a build's own folders, held by descriptor (``BuildRoom``), published by
                ``renameat``; removing through descriptors (``remove_at``)

Building needs root and the host tools debootstrap, e2fsprogs, kmod, dpkg,
apt and busybox-static. Recipes are built as root (debootstrap of Debian's
archive); templates run their packages and steps in a user namespace.
"""

from hangar.images.builder import build_image
from hangar.images.catalogue import ImageInfo, list_images, resolve_image, resolve_pinned
from hangar.images.guest_image import KERNEL_CMDLINE, GuestImage, image_id
from hangar.images.recipes import RECIPES, Recipe, get_recipe
from hangar.images.vmlinux import ensure_vmlinux, extract_vmlinux

__all__ = [
    "KERNEL_CMDLINE",
    "RECIPES",
    "GuestImage",
    "ImageInfo",
    "Recipe",
    "build_image",
    "ensure_vmlinux",
    "extract_vmlinux",
    "get_recipe",
    "image_id",
    "list_images",
    "resolve_image",
    "resolve_pinned",
]
