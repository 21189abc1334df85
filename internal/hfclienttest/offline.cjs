// Reads a Hugging Face hub cache with @huggingface/hub's own cache code,
// offline, and prints what it found as JSON on stdout. Run by
// hfclienttest.ReadCache:
//
//   node offline.cjs MODULE_DIR REPO REVISION PATH...
//
// MODULE_DIR holds node_modules/@huggingface/hub. The cache is the one the
// library finds by itself: $HF_HUB_CACHE (getHFHubCachePath).
//
// The library has no offline mode and no function that reads refs/<branch>
// to open a file (its downloadFileToCacheDir asks the hub's API for any
// revision that is not a commit). What it has, and what this uses:
//
//   1. scanCacheDir(): every repository of the cache, each revision with
//      the refs that name it (read from refs/: each file's content is the
//      commit) and the files of its snapshot (top level only, each with the
//      blob it links to, realpath'd and stat'ed). REPO is found by name and
//      REVISION by the ref of that name among its revisions' refs: that is
//      the commit the library takes REVISION to be.
//   2. downloadFileToCacheDir({revision: <that commit>}) for each PATH: for
//      a commit whose snapshot holds the file it returns the snapshot's path
//      without a request. Each file is then read through that path.
//
// Network access is made to fail: fetch is replaced by a function that
// throws, and hubUrl points at a closed port; a library that tried to reach
// the hub fails the run.
"use strict";

const path = require("node:path");
const fs = require("node:fs");

async function main() {
	const [moduleDir, repo, revision, ...paths] = process.argv.slice(2);
	if (!moduleDir || !repo || !revision) {
		throw new Error("usage: node offline.cjs MODULE_DIR REPO REVISION PATH...");
	}
	const networkAttempts = [];
	const noNetwork = async (input) => {
		networkAttempts.push(String(input && input.url ? input.url : input));
		throw new Error(`offline: a request to ${input} was attempted`);
	};
	globalThis.fetch = noNetwork;
	const hub = require(path.join(moduleDir, "node_modules", "@huggingface", "hub"));

	const out = { cacheDir: hub.getHFHubCachePath(), repos: [], warnings: [] };
	const info = await hub.scanCacheDir();
	out.warnings = info.warnings.map((w) => String(w && w.message ? w.message : w));
	for (const r of info.repos) {
		out.repos.push({
			type: r.id.type,
			name: r.id.name,
			path: r.path,
			revisions: r.revisions.map((rev) => ({
				commit: rev.commitOid,
				refs: [...rev.refs].sort(),
				path: rev.path,
				files: rev.files.map((f) => ({ path: f.path, blob: f.blob.path, size: f.blob.size })),
			})),
		});
	}

	const found = info.repos.find((r) => r.id.type === "model" && r.id.name === repo);
	if (found) {
		const rev = found.revisions.find((r) => r.refs.includes(revision));
		if (rev) {
			out.resolved = { commit: rev.commitOid, snapshot: rev.path, files: [] };
			for (const p of paths) {
				const pointer = await hub.downloadFileToCacheDir({
					repo: { type: "model", name: repo },
					path: p,
					revision: rev.commitOid,
					hubUrl: "http://127.0.0.1:9",
					fetch: noNetwork,
				});
				out.resolved.files.push({ path: p, pointer, content: fs.readFileSync(pointer).toString("base64") });
			}
		}
	}
	out.networkAttempts = networkAttempts;
	process.stdout.write(JSON.stringify(out));
}

main().catch((err) => {
	process.stderr.write(String(err && err.stack ? err.stack : err) + "\n");
	process.exit(1);
});
