# Sourced by the GPU scripts: SMOE_NCCL_LIBRARY, where unset, becomes torch's
# libnccl (the pip package nvidia-nccl), else the first libnccl.so.2 on disk.
if [ -z "${SMOE_NCCL_LIBRARY:-}" ]; then
  SMOE_NCCL_LIBRARY=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib','libnccl.so.2'))" 2>/dev/null)
  [ -f "$SMOE_NCCL_LIBRARY" ] || SMOE_NCCL_LIBRARY=$(find / -name 'libnccl.so.2' 2>/dev/null | head -1)
  export SMOE_NCCL_LIBRARY
fi
