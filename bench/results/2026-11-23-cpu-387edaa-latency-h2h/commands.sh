# The script of 2026-11-23-cpu-d2aa29f-latency-h2h/ run again as it stands (it writes /tmp/lat4), then its results copied here:
bash bench/results/2026-11-23-cpu-d2aa29f-latency-h2h/commands.sh
cp /tmp/lat4/latency-*.json bench/results/2026-11-23-cpu-387edaa-latency-h2h/
