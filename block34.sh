# one call: part 15 + install, then batch invariance of every shipped policy in four pytest
# processes at once (deterministic inference); results under $OUT as each finishes
bash .gpu/part15/receive.sh > $OUT/r15.txt 2>&1; tail -2 $OUT/r15.txt
export PYTHONPATH=/tmp/site; . bench/gpu_install.sh || { echo install failed; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
python3 -c "import sglang, torch, flashinfer; print(sglang.__version__, torch.__version__, flashinfer.__version__)" >> $OUT/gpu.txt 2>&1
bi() { mkdir -p /tmp/$3; TR_E2E_PORT=$2 TR_MODEL_PATH=/tmp/models/qwen2.5-0.5b TR_BI_POLICIES=$1 TR_E2E_MEM=0.17 TR_E2E_ARGS=--enable-deterministic-inference TR_E2E_OUT=/tmp/$3 timeout -k 10 420 python3 -P -m pytest -q -p no:cacheprovider tests/gpu/test_batch_invariance_e2e.py > /tmp/$3/bi.txt 2>&1; tar czf $OUT/$3.tgz -C /tmp $3; }
( bi qevict,h2o 31000 bi1 ) &
sleep 20; ( bi snapkv,streaming 31050 bi2 ) &
sleep 20; ( bi kivi,full 31100 bi3 ) &
sleep 20; ( bi rdkv 31150 bi4 ) &
wait
nvidia-smi --query-gpu=memory.used --format=csv >> $OUT/gpu.txt
tail -4 /tmp/bi1/bi.txt /tmp/bi2/bi.txt /tmp/bi3/bi.txt /tmp/bi4/bi.txt
