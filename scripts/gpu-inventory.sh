#!/usr/bin/env bash
# gpu-inventory.sh: check weightd's NVML inventory against nvidia-smi on a
# GPU machine.
#
# Usage (from anywhere in the repository, on a node with the NVIDIA driver):
#
#   scripts/gpu-inventory.sh [DRIFT_MIB]
#
# It builds weightd (cgo, for go-nvml), runs `weightd gpus --json` and
# `nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used`, and
# compares them GPU by GPU: the same GPUs, and for each the same UUID, name
# and total memory (MiB), and used memory (MiB) within DRIFT_MIB (default
# 256; memory in use moves between the two reads). It prints both tables and
# exits 0 when they match, 1 on a mismatch, 2 when something it needs (go,
# jq, nvidia-smi) is missing.
#
# Needs: go, jq, nvidia-smi.
set -euo pipefail

drift=${1:-256}
if ! [[ $drift =~ ^[0-9]+$ ]]; then
	echo "usage: $0 [DRIFT_MIB]" >&2
	exit 2
fi
for tool in go jq nvidia-smi; do
	if ! command -v "$tool" >/dev/null; then
		echo "gpu-inventory: $tool not found" >&2
		exit 2
	fi
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "building weightd" >&2
(cd "$root" && CGO_ENABLED=1 CGO_CFLAGS="${CGO_CFLAGS:--O2 -g -Wno-deprecated-declarations}" go build -o "$work/weightd" ./cmd/weightd)

"$work/weightd" gpus --json >"$work/weightd.json"
"$work/weightd" gpus
nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used --format=csv,noheader,nounits >"$work/smi.csv"
echo
echo "nvidia-smi:"
cat "$work/smi.csv"
echo

# weightd's view, in nvidia-smi's CSV shape: index, uuid, name, MiB total,
# MiB used.
jq -r '.[] | [.index, .uuid, .name, (.memoryTotalBytes / 1048576 | floor), (.memoryUsedBytes / 1048576 | floor)] | map(tostring) | join(",")' \
	"$work/weightd.json" >"$work/weightd.csv"

fail=0
mismatch() {
	echo "MISMATCH: $*"
	fail=1
}

declare -A ours
while IFS=, read -r index uuid name total used; do
	ours[$index]="$uuid,$name,$total,$used"
done <"$work/weightd.csv"

seen=0
while IFS=, read -r index uuid name total used; do
	# nvidia-smi pads fields after the commas.
	index=${index// /}
	uuid=${uuid// /}
	name=$(echo "$name" | sed 's/^ *//; s/ *$//')
	total=${total// /}
	used=${used// /}
	seen=$((seen + 1))
	if [[ -z ${ours[$index]+x} ]]; then
		mismatch "GPU $index: nvidia-smi lists it, weightd does not"
		continue
	fi
	IFS=, read -r ouuid oname ototal oused <<<"${ours[$index]}"
	[[ $ouuid == "$uuid" ]] || mismatch "GPU $index uuid: weightd $ouuid, nvidia-smi $uuid"
	[[ $oname == "$name" ]] || mismatch "GPU $index name: weightd '$oname', nvidia-smi '$name'"
	if ! [[ $total =~ ^[0-9]+$ && $used =~ ^[0-9]+$ ]]; then
		mismatch "GPU $index: nvidia-smi memory '$total' / '$used' is not a number"
		continue
	fi
	[[ $ototal == "$total" ]] || mismatch "GPU $index memory.total: weightd $ototal MiB, nvidia-smi $total MiB"
	diff=$((oused - used))
	if ((diff < 0)); then
		diff=$((-diff))
	fi
	((diff <= drift)) || mismatch "GPU $index memory.used: weightd $oused MiB, nvidia-smi $used MiB (over $drift MiB apart)"
done <"$work/smi.csv"

if ((seen != ${#ours[@]})); then
	mismatch "weightd lists ${#ours[@]} GPUs, nvidia-smi $seen"
fi
if ((fail)); then
	exit 1
fi
echo "weightd and nvidia-smi agree on $seen GPUs (used memory within $drift MiB)"
