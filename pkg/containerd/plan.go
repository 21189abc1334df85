package containerd

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/url"
	"os"
	"slices"
	"strings"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/labels"
	"github.com/containerd/platforms"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
)

// maxManifestSize bounds the index, manifest and config blobs read into
// memory (containerd's own limit for manifests is 4 MiB).
const maxManifestSize = 8 << 20

// plan is an image checked against the cache and ready to import: every
// blob open, its kind known, the labels containerd's GC needs computed.
type plan struct {
	name    string   // the normalised reference: the image record's name
	records []string // name, then the repository digest and the ID records the CRI keeps
	target  ocispec.Descriptor
	// blobs in import order: layers and config first, then the manifest,
	// then the index, so that parents are committed after their children.
	blobs []*planBlob
}

type planBlob struct {
	desc   ocispec.Descriptor
	file   *os.File
	labels map[string]string // GC references and distribution source
	parent bool              // a manifest or an index: written after its children
}

func (p *plan) close() {
	for _, b := range p.blobs {
		if b.file != nil {
			b.file.Close()
		}
	}
}

// errInvalidImage marks an image that no retry can import; it is wrapped
// with cache.Permanent.
var errInvalidImage = errors.New("invalid image")

func invalid(format string, args ...any) error {
	return cache.Permanent(fmt.Errorf("%w: "+format, append([]any{errInvalidImage}, args...)...))
}

// newPlan checks img, opens its blobs in the cache, reads its index and
// manifest and works out what to write. It closes what it opened on error.
func newPlan(img *prefetch.Image, blobs BlobOpener, platform platforms.MatchComparer, platformName string) (_ *plan, err error) {
	if img == nil {
		return nil, invalid("no image")
	}
	named, err := reference.ParseNormalizedNamed(img.Name)
	if err != nil {
		return nil, invalid("image name %q: %v", img.Name, err)
	}
	named = reference.TagNameOnly(named) // "busybox" is busybox:latest, as for a pull
	p := &plan{name: named.String()}
	defer func() {
		if err != nil {
			p.close()
		}
	}()
	distKey, distRepo := distributionSource(named)

	byDigest := make(map[digest.Digest]*planBlob, len(img.Blobs))
	for _, b := range img.Blobs {
		if err := b.Validate(); err != nil {
			return nil, invalid("image %s: blob %s: %v", p.name, b.Digest, err)
		}
		if b.MediaType == "" {
			return nil, invalid("image %s: blob %s has no media type", p.name, b.Digest)
		}
		if prev, ok := byDigest[b.Digest]; ok {
			if prev.desc.Size != b.Size {
				return nil, invalid("image %s: blob %s listed with sizes %d and %d", p.name, b.Digest, prev.desc.Size, b.Size)
			}
			continue
		}
		pb := &planBlob{
			desc:   ocispec.Descriptor{MediaType: b.MediaType, Digest: b.Digest, Size: b.Size},
			labels: map[string]string{},
		}
		if distKey != "" {
			pb.labels[distKey] = distRepo
		}
		byDigest[b.Digest] = pb
	}
	t, ok := byDigest[img.Target.Digest]
	if err := img.Target.Validate(); err != nil || !ok || t.desc.Size != img.Target.Size {
		return nil, invalid("image %s: target %s is not among its blobs", p.name, img.Target.Digest)
	}
	if img.Target.MediaType != "" && img.Target.MediaType != t.desc.MediaType {
		return nil, invalid("image %s: target %s is %s, its blob %s", p.name, img.Target.Digest, img.Target.MediaType, t.desc.MediaType)
	}
	p.target = t.desc
	if dn, ok := named.(reference.Digested); ok && dn.Digest() != p.target.Digest {
		return nil, invalid("image %s: the name's digest is not the target's, %s", p.name, p.target.Digest)
	}

	// Open every blob first: a blob missing from the cache fails the import
	// before anything is written to containerd.
	for _, b := range img.Blobs {
		pb := byDigest[b.Digest]
		if pb.file != nil {
			continue
		}
		f, err := blobs.Open(b.Digest)
		if err != nil {
			return nil, fmt.Errorf("image %s: blob %s is not in the cache: %w", p.name, b.Digest, err)
		}
		pb.file = f
		p.blobs = append(p.blobs, pb) // closed by p.close from here on
		fi, err := f.Stat()
		if err != nil {
			return nil, fmt.Errorf("image %s: blob %s in the cache: %w", p.name, b.Digest, err)
		}
		if fi.Size() != b.Size {
			return nil, fmt.Errorf("image %s: blob %s is %d bytes in the cache, not %d: %w", p.name, b.Digest, fi.Size(), b.Size, cache.ErrSizeMismatch)
		}
	}

	var index *planBlob
	manifest := t
	if images.IsIndexType(t.desc.MediaType) {
		index = t
		var idx ocispec.Index
		if err := readJSON(t, &idx); err != nil {
			return nil, invalid("image %s: index %s: %v", p.name, t.desc.Digest, err)
		}
		// The manifest containerd will pick for the platform (as
		// images.Manifest does): the best match among the index's.
		var matching []ocispec.Descriptor
		for _, m := range idx.Manifests {
			if images.IsManifestType(m.MediaType) && (m.Platform == nil || platform.Match(*m.Platform)) {
				matching = append(matching, m)
			}
		}
		slices.SortStableFunc(matching, func(a, b ocispec.Descriptor) int {
			switch {
			case a.Platform == nil && b.Platform == nil:
				return 0
			case a.Platform == nil:
				return 1
			case b.Platform == nil:
				return -1
			case platform.Less(*a.Platform, *b.Platform):
				return -1
			case platform.Less(*b.Platform, *a.Platform):
				return 1
			}
			return 0
		})
		if len(matching) == 0 {
			return nil, invalid("image %s: index %s has no manifest for %s", p.name, t.desc.Digest, platformName)
		}
		m, ok := byDigest[matching[0].Digest]
		if !ok || m.desc.Size != matching[0].Size {
			return nil, invalid("image %s: the manifest for %s, %s, is not among its blobs", p.name, platformName, matching[0].Digest)
		}
		manifest = m
		// Reference the manifests present, as containerd does for the
		// manifests of an index it pulled for one platform.
		var present []ocispec.Descriptor
		for _, c := range idx.Manifests {
			if b, ok := byDigest[c.Digest]; ok && b.desc.Size == c.Size {
				present = append(present, c)
			}
		}
		maps.Copy(index.labels, childLabels(present))
	} else if !images.IsManifestType(t.desc.MediaType) {
		return nil, invalid("image %s: target %s has media type %q, neither an index nor a manifest", p.name, t.desc.Digest, t.desc.MediaType)
	}

	var m ocispec.Manifest
	if err := readJSON(manifest, &m); err != nil {
		return nil, invalid("image %s: manifest %s: %v", p.name, manifest.desc.Digest, err)
	}
	children := append([]ocispec.Descriptor{m.Config}, m.Layers...)
	for _, c := range children {
		b, ok := byDigest[c.Digest]
		if !ok || b.desc.Size != c.Size {
			return nil, invalid("image %s: manifest %s lists %s of %d bytes, which is not among its blobs", p.name, manifest.desc.Digest, c.Digest, c.Size)
		}
	}
	maps.Copy(manifest.labels, childLabels(children))

	p.records = []string{p.name}
	if _, tagged := named.(reference.Tagged); tagged {
		if rd, err := reference.WithDigest(reference.TrimNamed(named), p.target.Digest); err == nil {
			p.records = append(p.records, rd.String())
		}
	}
	p.records = append(p.records, m.Config.Digest.String())

	config := byDigest[m.Config.Digest]
	var cfg ocispec.Image
	if err := readJSON(config, &cfg); err != nil {
		return nil, invalid("image %s: config %s: %v", p.name, m.Config.Digest, err)
	}
	if index == nil {
		// A lone manifest: containerd checks its config's platform.
		cp := platforms.Normalize(ocispec.Platform{OS: cfg.OS, Architecture: cfg.Architecture, Variant: cfg.Variant})
		if !platform.Match(cp) {
			return nil, invalid("image %s is for %s, not %s", p.name, platforms.Format(cp), platformName)
		}
	}
	if len(cfg.RootFS.DiffIDs) != len(m.Layers) {
		return nil, invalid("image %s: config %s has %d diff IDs for %d layers", p.name, m.Config.Digest, len(cfg.RootFS.DiffIDs), len(m.Layers))
	}

	// Import order: the layers and the config, the manifest, the index.
	// Blobs of other platforms' manifests (listed but not referenced from
	// the chosen one) go along with the layers.
	var order []*planBlob
	for _, b := range p.blobs {
		if b != manifest && b != index {
			order = append(order, b)
		}
	}
	manifest.parent = true
	order = append(order, manifest)
	if index != nil {
		index.parent = true
		order = append(order, index)
	}
	p.blobs = order
	return p, nil
}

// childLabels are the containerd.io/gc.ref.content.* labels that make a
// parent blob keep its children, numbered as containerd numbers them.
func childLabels(children []ocispec.Descriptor) map[string]string {
	out := make(map[string]string, len(children))
	seen := map[string]int{}
	for _, c := range children {
		for _, key := range images.ChildGCLabels(c) {
			i := seen[key]
			seen[key] = i + 1
			if strings.HasSuffix(key, ".sha256.") { // referrers: keyed by digest
				key += c.Digest.Encoded()[:min(12, len(c.Digest.Encoded()))]
			} else if i > 0 || strings.HasSuffix(key, ".") {
				key = fmt.Sprintf("%s%d", key, i)
			}
			out[key] = c.Digest.String()
		}
	}
	return out
}

// distributionSource is the containerd.io/distribution.source.<host> label
// containerd puts on what it pulls from host's repository (the host without
// its port, as containerd does), or "" if it would not be a valid label.
func distributionSource(named reference.Named) (key, repo string) {
	u, err := url.Parse("dummy://" + reference.Domain(named))
	if err != nil || u.Hostname() == "" {
		return "", ""
	}
	key, repo = labels.LabelDistributionSource+"."+u.Hostname(), reference.Path(named)
	if labels.Validate(key, repo) != nil {
		return "", ""
	}
	return key, repo
}

func readJSON(b *planBlob, v any) error {
	if b.desc.Size > maxManifestSize {
		return fmt.Errorf("%d bytes, more than the %d allowed", b.desc.Size, maxManifestSize)
	}
	data, err := io.ReadAll(io.NewSectionReader(b.file, 0, b.desc.Size))
	if err != nil {
		return err
	}
	return json.Unmarshal(data, v)
}
