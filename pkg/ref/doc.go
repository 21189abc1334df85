// Package ref is the grammar of the references weightd fetches: it parses
// and validates them (Parse), prints them in canonical form (Ref.String)
// and without credentials (Ref.Redacted), and says whether one names
// immutable content (Ref.Pinned). It depends on no source, registry or
// cache code, so that whatever only reads references (pod annotations, the
// scheduler extender, policies, CSI volumes) needs nothing else.
//
// A reference names a model, an image or a single file where it can be
// fetched from:
//
//	oci://ghcr.io/org/llama:v1                    an image or a ModelPack model artifact, by tag ("latest" if none)
//	oci://ghcr.io/org/llama@sha256:<64 hex>       the same, pinned by manifest or index digest (a tag before it is kept as a name)
//	hf://meta-llama/Llama-3.1-8B@main             a Hugging Face style hub repository at a branch, tag or commit ("main" if none)
//	https://host/path/model.json                  a model manifest
//	https://host/path/file.bin#sha256:<64 hex>    one file pinned by its digest
//	s3://bucket/prefix                            the model under an S3 prefix (or the whole bucket)
//	s3://bucket/prefix@<version id>               the same, its model.json at that S3 object version
//	s3://bucket/key#sha256:<64 hex>               one object pinned by its digest
//
// Every reference is at most MaxLength bytes of printable ASCII without
// spaces or control characters (internationalised host names must be given
// in punycode), and of the form scheme://…, the scheme in any case.
//
// oci://registry[:port]/repository[:tag][@sha256:<64 hex>] follows the
// distribution project's reference grammar: the registry is always named
// (no implicit Docker Hub) as DNS labels or a bracketed IPv6 address, with
// a port from 1 to 65535; the repository is at most 255 bytes of
// '/'-separated components of lowercase letters and digits, separated by
// '.', '_', '__' or '-'; a tag is letters, digits, '_', '.' and '-', at most
// 128, not starting with '.' or '-'.
//
// hf://[org/]name[@revision] follows the hub's naming rules: each part of
// the name is letters, digits, '.', '_' and '-' (no "--" or ".."), at most
// 96, starting and ending with a letter or digit; the revision is a
// branch, tag or commit of letters, digits, '.', '_', '-' and '/' (such as
// "refs/pr/1"), at most 255 bytes. A 40-hex commit pins it.
//
// An http or https reference is an absolute URL with a host, no user
// information (use a credential instead), a port from 1 to 65535 if any,
// and a path that names a file (not empty and not ending in '/'). A query
// is kept as it is (presigned object-store URLs need it). A fragment, if
// present, must be exactly a canonical sha256 digest ("sha256:" and 64
// lowercase hex digits); it pins a single file.
//
// s3://bucket[/prefix][@version] or s3://bucket/key#sha256:<64 hex> names
// a bucket as AWS allows it (3–63 lowercase letters, digits, '.' and '-',
// a letter or digit at each end, no "..", not an IP address), a key prefix
// of at most 1024 bytes of non-empty segments other than "." and "..",
// without '@', '#', '?' or '\' (a trailing '/' is dropped), and a version
// being an S3 object version id. A digest pins one object and excludes a
// version.
//
// Every error wraps ErrInvalid.
package ref
