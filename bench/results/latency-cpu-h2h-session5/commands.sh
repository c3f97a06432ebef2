# The session-4 script run again as it stands (it writes /tmp/lat4), then its results copied here:
bash bench/results/latency-cpu-h2h-session4/commands.sh
cp /tmp/lat4/latency-*.json bench/results/latency-cpu-h2h-session5/
