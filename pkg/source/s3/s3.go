package s3

import (
	"context"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/aws/aws-sdk-go-v2/aws"
	awsmiddleware "github.com/aws/aws-sdk-go-v2/aws/middleware"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/feature/ec2/imds"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	smithyhttp "github.com/aws/smithy-go/transport/http"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	httpsource "github.com/weightd/weightd/pkg/source/http"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// ManifestName is the key, under a reference's prefix, of the model.json
// (see httpsource.Manifest) that Source reads first.
const ManifestName = "model.json"

// ErrUnverifiable is Source's refusal of objects it has no sha256 for:
// no model.json beside them, no full-object SHA-256 checksum kept by the
// store, and no digest in the reference.
var ErrUnverifiable = errors.New("no sha256 to verify the object against")

// headConcurrency bounds the HEAD requests that read a listing's
// checksums: a model has a few to a few thousand objects.
const headConcurrency = 16

// Source resolves ref.KindS3 references against one S3 endpoint (AWS, or
// an S3-compatible store: MinIO, Ceph RGW, R2, GCS interop) and reads their
// objects with ranged GetObject requests.
//
// Where a model's files and their sha256 come from, in order (model.json
// before checksums: it is the publisher's explicit list, and one request
// rather than a HEAD per object):
//
//  1. s3://bucket/key#sha256:… names one object, pinned by that digest:
//     a one-file model named as httpsource.Source names a pinned URL's.
//  2. a model.json (see httpsource.Manifest) at <prefix>/model.json: its files are the
//     model, each read from <prefix>/<path> ("url" is refused: an S3 model's
//     files live beside its manifest). s3://bucket/prefix@VERSION reads the
//     model.json at that S3 object version: object versions never change,
//     and the manifest pins every file by digest, so the reference names
//     immutable content even though S3 versions each object separately.
//  3. without a model.json, the objects listed under <prefix>/, each with
//     the full-object SHA-256 checksum the store keeps (HeadObject with
//     ChecksumMode ENABLED). A composite checksum (of a multipart upload's
//     parts) is not the object's sha256 and does not count. An object
//     without one refuses the whole model (ErrUnverifiable): nothing
//     unverified is ever stored.
//
// A model is laid out under the name of "s3://bucket/prefix"
// (source.ModelName), never under a name the store's content gives; a listed
// model's revision is the commit-like id of its files (httpsource.FilesRevision), a
// manifest's as httpsource.Source lays it out.
//
// Credentials: requests carry the agent's credentials (WithCredentials)
// for the operator, and for a pod's namespace only where a source.AgentCredentials
// rule names "s3://bucket" and the namespace; every other request is
// anonymous, so a pod reads what the public may read.
type Source struct {
	agent *s3.Client // nil without credentials
	anon  *s3.Client
	creds source.AgentCredentials
}

// options configures a Source.
type options struct {
	endpoint  string
	region    string
	pathStyle bool
	creds     aws.CredentialsProvider
	rules     source.AgentCredentials
}

// Option configures a Source.
type Option func(*options) error

// WithEndpoint sets the endpoint of an S3-compatible store: an absolute
// http or https URL without query, fragment or user information. The
// default is AWS's regional endpoint.
func WithEndpoint(endpoint string) Option {
	return func(o *options) error {
		u, err := url.Parse(endpoint)
		switch {
		case err != nil:
			if ue, ok := err.(*url.Error); ok {
				err = ue.Err
			}
			return fmt.Errorf("%w: S3 endpoint: %v", content.ErrInvalid, err)
		case u.Scheme != "http" && u.Scheme != "https":
			return fmt.Errorf("%w: S3 endpoint %q: scheme must be http or https", content.ErrInvalid, fetch.Truncate(endpoint))
		case u.Opaque != "" || u.Hostname() == "":
			return fmt.Errorf("%w: S3 endpoint %q: want scheme://host[:port][/path]", content.ErrInvalid, fetch.Truncate(endpoint))
		case u.User != nil || u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
			return fmt.Errorf("%w: S3 endpoint %q: no user information, query or fragment allowed", content.ErrInvalid, fetch.Truncate(endpoint))
		case u.Port() != "" && !ref.ValidPort(u.Port()):
			return fmt.Errorf("%w: S3 endpoint %q: port out of range", content.ErrInvalid, fetch.Truncate(endpoint))
		}
		o.endpoint = endpoint
		return nil
	}
}

// WithRegion sets the region requests are signed for. The default is
// us-east-1, which S3-compatible stores generally accept; AWS answers a
// bucket of another region with a redirect that is not followed.
func WithRegion(region string) Option {
	return func(o *options) error {
		o.region = region
		return nil
	}
}

// WithPathStyle addresses buckets in the path (https://host/bucket/key)
// rather than the host name (https://bucket.host/key), as most self-hosted
// stores need.
func WithPathStyle(on bool) Option {
	return func(o *options) error {
		o.pathStyle = on
		return nil
	}
}

// WithCredentials sets the agent's own credentials (see
// LoadCredentials); without them every request is anonymous.
func WithCredentials(p aws.CredentialsProvider) Option {
	return func(o *options) error {
		o.creds = p
		return nil
	}
}

// WithAgentCredentials says for which requesters (see source.WithRequester) the
// agent's credentials are used: always for the operator, for a pod's
// namespace only where a rule names "s3://bucket" and the namespace.
func WithAgentCredentials(a source.AgentCredentials) Option {
	return func(o *options) error {
		o.rules = a
		return nil
	}
}

// New returns a source whose requests go through client (nil: a
// client over http.DefaultTransport).
func New(client *http.Client, opts ...Option) (*Source, error) {
	if client == nil {
		client = &http.Client{Transport: http.DefaultTransport}
	}
	o := options{region: "us-east-1"}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	newClient := func(creds aws.CredentialsProvider) *s3.Client {
		return s3.New(s3.Options{
			Region:       o.region,
			Credentials:  creds,
			HTTPClient:   client,
			UsePathStyle: o.pathStyle,
			BaseEndpoint: nilIfEmpty(o.endpoint),
			// The cache retries, resumes and detects stalls; a second,
			// hidden layer of retries would only hide a dead origin.
			Retryer: aws.NopRetryer{},
			// The cache verifies every byte against the sha256; the SDK's
			// own validation would hash everything twice.
			ResponseChecksumValidation: aws.ResponseChecksumValidationWhenRequired,
			RequestChecksumCalculation: aws.RequestChecksumCalculationWhenRequired,
		})
	}
	s := &Source{anon: newClient(aws.AnonymousCredentials{}), creds: o.rules}
	if o.creds != nil {
		s.agent = newClient(o.creds)
	}
	return s, nil
}

func nilIfEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// LoadCredentials returns the AWS SDK's default credential chain
// (environment, shared config and credentials files, web identity for IRSA,
// the container endpoint of EKS Pod Identity) and the region configured
// with it ("" if none). The instance metadata service (IMDS) is part of the
// chain only with allowIMDS: the node's instance role is the node's, not
// the agent's, and pods name what the agent fetches: with it, a pod author
// whose namespace may use the agent's credentials would read what only the
// node was meant to, and an agent given no credentials would have some.
func LoadCredentials(ctx context.Context, allowIMDS bool) (aws.CredentialsProvider, string, error) {
	state := imds.ClientDisabled
	if allowIMDS {
		state = imds.ClientEnabled
	}
	cfg, err := config.LoadDefaultConfig(ctx, config.WithEC2IMDSClientEnableState(state))
	if err != nil {
		return nil, "", fmt.Errorf("loading AWS configuration: %w", err)
	}
	return cfg.Credentials, cfg.Region, nil
}

// Resolve reads the model a reference names (see Source) and returns it
// with one ranged-GetObject opener per blob.
func (s *Source) Resolve(ctx context.Context, r ref.Ref) (*source.Resolution, error) {
	if r.Kind != ref.KindS3 || r.URL == nil {
		return nil, content.Permanent(fmt.Errorf("resolving %s: kind %q: %w", r.Redacted(), r.Kind, errors.ErrUnsupported))
	}
	c, note := s.anon, ""
	if ns := source.Requester(ctx); s.agent != nil {
		if s.creds.Allow(credentialHost(r.URL.Host), ns) {
			c = s.agent
		} else {
			note = fmt.Sprintf(" (the agent's S3 credentials are not used for namespace %q)", ns)
		}
	}
	b := s3Bucket{c: c, bucket: r.URL.Host}
	var (
		res *source.Resolution
		err error
	)
	if r.Digest != "" {
		res, err = b.resolveObject(ctx, r)
	} else {
		res, err = b.resolvePrefix(ctx, r)
	}
	if err != nil {
		return nil, fmt.Errorf("resolving %s: %w%s", r.Redacted(), err, note)
	}
	return res, nil
}

// credentialHost is how source.AgentCredentials rules name a bucket.
func credentialHost(bucket string) string { return "s3://" + bucket }

// s3Bucket makes one requester's requests to one bucket.
type s3Bucket struct {
	c      *s3.Client
	bucket string
}

func (b s3Bucket) resolveObject(ctx context.Context, r ref.Ref) (*source.Resolution, error) {
	key := r.KeyPrefix()
	size, sum, err := b.head(ctx, key)
	if err != nil {
		return nil, err
	}
	if sum != "" && sum != r.Digest {
		return nil, content.Permanent(fmt.Errorf("%w: %s: the store's SHA-256 checksum is %s, the reference pins %s", content.ErrDigestMismatch, b.name(key), sum, r.Digest))
	}
	m := source.SingleFileModel(r.URL, r.Digest, size)
	if err := m.Validate(); err != nil {
		return nil, content.Permanent(err)
	}
	return &source.Resolution{Model: m, Blobs: map[digest.Digest]content.RangeOpener{r.Digest: b.blob(key, size)}}, nil
}

func (b s3Bucket) resolvePrefix(ctx context.Context, r ref.Ref) (*source.Resolution, error) {
	prefix := r.KeyPrefix()
	if prefix != "" {
		prefix += "/"
	}
	m, err := b.manifest(ctx, prefix+ManifestName, r.Revision)
	switch {
	case err == nil:
		return b.fromManifest(r, prefix, m)
	case !errors.Is(err, errNoObject):
		return nil, err
	case r.Revision != "":
		return nil, fmt.Errorf("%w: a version pins the prefix's %s, which has no such object version: %w", content.ErrInvalid, ManifestName, err)
	}
	return b.fromListing(ctx, r, prefix)
}

// errNoObject is a 404: the key (or version) does not exist.
var errNoObject = errors.New("no such object")

func (b s3Bucket) manifest(ctx context.Context, key, version string) (*httpsource.Manifest, error) {
	out, err := b.c.GetObject(ctx, &s3.GetObjectInput{Bucket: &b.bucket, Key: &key, VersionId: nilIfEmpty(version)})
	if err != nil {
		return nil, b.classify("GET", key, err)
	}
	defer out.Body.Close()
	if aws.ToInt64(out.ContentLength) > httpsource.MaxManifestSize {
		return nil, content.Permanent(fmt.Errorf("%w: %s of %d bytes is larger than %d", content.ErrInvalid, b.name(key), aws.ToInt64(out.ContentLength), httpsource.MaxManifestSize))
	}
	m, err := httpsource.ReadManifest(out.Body)
	if err != nil {
		if errors.Is(err, content.ErrInvalid) {
			return nil, content.Permanent(fmt.Errorf("%s: %w", b.name(key), err))
		}
		return nil, fmt.Errorf("%s: %w", b.name(key), err)
	}
	return m, nil
}

func (b s3Bucket) fromManifest(r ref.Ref, prefix string, m *httpsource.Manifest) (*source.Resolution, error) {
	res := &source.Resolution{Model: m.Layout(source.ModelName(r)), Blobs: make(map[digest.Digest]content.RangeOpener, len(m.Files))}
	for _, f := range m.Files {
		if f.URL != "" {
			return nil, content.Permanent(fmt.Errorf("%w: %s: file %q has a url: an S3 model's files are read from the keys beside its %s", content.ErrInvalid, b.name(prefix+ManifestName), fetch.Truncate(f.Path), ManifestName))
		}
		if _, ok := res.Blobs[f.Digest()]; !ok {
			res.Blobs[f.Digest()] = b.blob(prefix+f.Path, f.Size)
		}
	}
	return res, nil
}

func (b s3Bucket) fromListing(ctx context.Context, r ref.Ref, prefix string) (*source.Resolution, error) {
	var files []content.File
	p := s3.NewListObjectsV2Paginator(b.c, &s3.ListObjectsV2Input{Bucket: &b.bucket, Prefix: &prefix})
	for p.HasMorePages() {
		page, err := p.NextPage(ctx)
		if err != nil {
			return nil, b.classify("LIST", prefix, err)
		}
		for _, obj := range page.Contents {
			key := aws.ToString(obj.Key)
			rel, ok := strings.CutPrefix(key, prefix)
			if !ok {
				return nil, content.Permanent(fmt.Errorf("%w: listing %s returned %q, outside the prefix", content.ErrInvalid, b.name(prefix), fetch.Truncate(key)))
			}
			if (rel == "" || strings.HasSuffix(rel, "/")) && aws.ToInt64(obj.Size) == 0 {
				continue // a "folder" marker some tools write
			}
			if err := content.ValidatePath(rel); err != nil {
				return nil, content.Permanent(fmt.Errorf("%s: %w", b.name(key), err))
			}
			if len(files) == httpsource.MaxManifestFiles {
				return nil, content.Permanent(fmt.Errorf("%w: more than %d objects under %s", content.ErrInvalid, httpsource.MaxManifestFiles, b.name(prefix)))
			}
			files = append(files, content.File{Path: rel})
		}
	}
	if len(files) == 0 {
		return nil, content.Permanent(fmt.Errorf("%w: no objects under %s", content.ErrNotFound, b.name(prefix)))
	}

	// The listing names no checksums: ask each object for its own.
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(headConcurrency)
	for i := range files {
		g.Go(func() error {
			size, sum, err := b.head(gctx, prefix+files[i].Path)
			if err != nil {
				return err
			}
			if sum == "" {
				return content.Permanent(fmt.Errorf("%w: %s has no full-object SHA-256 checksum: put a %s beside the objects, upload them with full-object SHA-256 checksums, or pin one object by digest (s3://%s/KEY#sha256:…)",
					ErrUnverifiable, b.name(prefix+files[i].Path), ManifestName, b.bucket))
			}
			files[i].Descriptor = content.Descriptor{Digest: sum, Size: size}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}

	m := content.Model{Name: source.ModelName(r), Revision: httpsource.FilesRevision(files), Files: files}
	if err := m.Validate(); err != nil {
		return nil, content.Permanent(err)
	}
	res := &source.Resolution{Model: m, Blobs: make(map[digest.Digest]content.RangeOpener, len(files))}
	sizes := make(map[digest.Digest]int64, len(files))
	for _, f := range files {
		if size, ok := sizes[f.Digest]; ok {
			if size != f.Size {
				return nil, content.Permanent(fmt.Errorf("%w: sha256 %s with sizes %d and %d under %s", content.ErrInvalid, f.Digest, size, f.Size, b.name(prefix)))
			}
			continue
		}
		sizes[f.Digest] = f.Size
		res.Blobs[f.Digest] = b.blob(prefix+f.Path, f.Size)
	}
	return res, nil
}

// head returns an object's size and, where the store keeps one, its
// full-object SHA-256 checksum as a digest ("" otherwise).
func (b s3Bucket) head(ctx context.Context, key string) (int64, digest.Digest, error) {
	out, err := b.c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: &b.bucket, Key: &key, ChecksumMode: types.ChecksumModeEnabled})
	if err != nil {
		return 0, "", b.classify("HEAD", key, err)
	}
	size := aws.ToInt64(out.ContentLength)
	if size < 0 {
		return 0, "", content.Permanent(fmt.Errorf("%w: %s: negative size %d", content.ErrInvalid, b.name(key), size))
	}
	return size, fullObjectSHA256(out.ChecksumSHA256, out.ChecksumType), nil
}

// fullObjectSHA256 is the digest an x-amz-checksum-sha256 gives, if it is
// the whole object's: a composite checksum (type COMPOSITE, or a value
// with a "-<parts>" suffix from stores that do not say the type) is a hash
// of the parts' hashes, which no byte stream hashes to.
func fullObjectSHA256(value *string, typ types.ChecksumType) digest.Digest {
	v := aws.ToString(value)
	if v == "" || typ == types.ChecksumTypeComposite || strings.Contains(v, "-") {
		return ""
	}
	sum, err := base64.StdEncoding.DecodeString(v)
	if err != nil || len(sum) != 32 {
		return ""
	}
	return digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(sum))
}

// blob reads an object of size bytes with ranged GetObject requests; the
// response is checked as httpsource.Source checks its own (fetch.CheckRange).
func (b s3Bucket) blob(key string, size int64) fetch.Blob {
	return fetch.Blob{Size: size, Fetch: func(ctx context.Context, off, end int64) (io.ReadCloser, error) {
		rng := "bytes=" + strconv.FormatInt(off, 10) + "-" + strconv.FormatInt(end-1, 10)
		out, err := b.c.GetObject(ctx, &s3.GetObjectInput{Bucket: &b.bucket, Key: &key, Range: &rng})
		if err != nil {
			return nil, b.classify("GET", key, err)
		}
		raw, ok := awsmiddleware.GetRawResponse(out.ResultMetadata).(*smithyhttp.Response)
		if !ok {
			out.Body.Close()
			return nil, fmt.Errorf("GET %s: no HTTP response", b.name(key))
		}
		if err := fetch.CheckRange(raw.Response, off, end, size); err != nil {
			fetch.DrainClose(out.Body)
			return nil, fmt.Errorf("GET %s: %w", b.name(key), err)
		}
		if raw.StatusCode == http.StatusOK && off > 0 {
			if _, err := io.CopyN(io.Discard, out.Body, off); err != nil {
				out.Body.Close()
				return nil, fmt.Errorf("GET %s: skipping %d bytes of a response that ignored Range: %w", b.name(key), off, err)
			}
		}
		return out.Body, nil
	}}
}

// classify wraps an SDK error with the request it failed and marks what
// retrying cannot fix permanent, by HTTP status as statusError does; a 404
// wraps errNoObject, a 416 content.ErrSizeMismatch.
func (b s3Bucket) classify(op, key string, err error) error {
	err = fmt.Errorf("%s %s: %w", op, b.name(key), err)
	var re *awshttp.ResponseError
	if !errors.As(err, &re) {
		return err
	}
	switch c := re.HTTPStatusCode(); {
	case c == http.StatusNotFound:
		return content.Permanent(fmt.Errorf("%w: %w", errNoObject, err))
	case c == http.StatusRequestedRangeNotSatisfiable:
		return content.Permanent(fmt.Errorf("%w: %w", content.ErrSizeMismatch, err))
	case c == http.StatusRequestTimeout, c == http.StatusTooEarly, c == http.StatusTooManyRequests:
		return err
	case c >= 400 && c < 500:
		return content.Permanent(err)
	}
	return err
}

// name is "s3://bucket/key" for messages.
func (b s3Bucket) name(key string) string { return "s3://" + b.bucket + "/" + key }
