#!/bin/sh
# On the device machine: the kernel / runner tests at full sizes on CUDA, then the sparse benchmarks.
#   sh scripts/gpu_sparse.sh tests|products|kernels|attention|decode   (results under $OUT)
# products: the row-invariant / FP8 matrix products and norms, and the speculative steps that use them
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
case "$1" in
  tests) python3 -m pytest -q -p no:cacheprovider tests/test_kernels_sparse.py tests/test_kernel_attend.py \
           tests/test_kernel_kmeans.py tests/test_kernel_clusters.py tests/test_doublep.py tests/test_runner.py -m "not slow" tests/test_cuda.py -k "sparse or kernel or select or score or probe or encode or attention or fixed or graph or verify or keys or table or fit or block or spec or nearest or ties or fast_mode or rows or dead or doublep" 2>&1 | tee $OUT/tests.log ;;
  products) python3 -m pytest -q -p no:cacheprovider tests/test_kernel_matmul.py tests/test_kernel_norm.py \
           tests/test_fp8_drafts.py tests/test_cuda.py -k "matmul or norm or fp8 or row_invariant or reads_back" \
           2>&1 | tee $OUT/products.log ;;
  kernels) python3 -m pytest -q -p no:cacheprovider tests/test_kernels_sparse.py 2>&1 | tee $OUT/kernels.log ;;
  attention) python3 -m sparsespec bench attention --out $OUT 2>&1 | tee $OUT/attention.log ;;
  decode) python3 -m sparsespec bench decode --out $OUT 2>&1 | tee $OUT/decode.log ;;
esac
