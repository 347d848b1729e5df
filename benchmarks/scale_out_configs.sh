# Sourced by the scale_out*.sh benchmarks: the server flags of each data-parallel
# configuration, with the same KV memory in total ($KV blocks, default 512, for one
# replica; half each for two). Prints the flags of CONFIG: dp1t2 (1 replica x 2 threads),
# dp1t1 (1 x 1), dp2-<router> (2 replicas x 1 thread behind that router).
config_flags() {
  local kv=${KV:-512}
  case $1 in
    dp1t2) echo "--num-threads 2 --num-kv-blocks $kv" ;;
    dp1t1) echo "--num-threads 1 --num-kv-blocks $((kv / 2))" ;;
    dp2-*) echo "--data-parallel-size 2 --num-threads 1 --num-kv-blocks $((kv / 2)) --router ${1#dp2-}" ;;
    *) echo "unknown config $1" >&2; return 2 ;;
  esac
}
