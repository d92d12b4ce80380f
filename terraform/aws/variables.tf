variable "region" {
  description = "AWS region of the bucket (volunteers must use the same one, e.g. AWS_DEFAULT_REGION)."
  type        = string
  default     = "us-east-1"
}

variable "bucket_name" {
  description = "Globally unique S3 bucket name for the run (the rendezvous bucket)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be a valid S3 bucket name (3-63 chars, lowercase letters, digits, dots, hyphens)."
  }
}

variable "key_prefix" {
  description = "Optional key prefix inside the bucket (\"\" or something like \"runs/calc/\"); the run then lives at s3://BUCKET/PREFIX."
  type        = string
  default     = ""

  validation {
    condition     = var.key_prefix == "" || can(regex("^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*/$", var.key_prefix))
    error_message = "key_prefix must be empty or look like \"a/b/\": no leading slash, a trailing slash, no wildcards."
  }

  # The policies repeat the prefix (the trainer's some 17 times) and IAM caps a policy's size.
  validation {
    condition     = length(var.key_prefix) <= 200
    error_message = "key_prefix must be at most 200 characters."
  }
}

variable "name_prefix" {
  description = "Prefix of the IAM user and group names this module creates."
  type        = string
  default     = "vrl"

  validation {
    condition     = can(regex("^[A-Za-z0-9+=,.@_-]{1,24}$", var.name_prefix))
    error_message = "name_prefix must be 1-24 characters valid in IAM names."
  }
}

variable "volunteers" {
  description = "Names of the volunteers. Each gets its own IAM user, access key and policy scoped to rollouts/*/NAME/ and volunteers/NAME.json. The name is the --id the volunteer must run with. Remove a name and apply to revoke that volunteer."
  type        = set(string)
  default     = []

  validation {
    condition     = alltrue([for v in var.volunteers : can(regex("^[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?$", v))])
    error_message = "Each volunteer name must be 1-20 characters: lowercase letters, digits and inner hyphens."
  }
}

variable "rollout_expiration_days" {
  description = "Delete rollout shards (rollouts/) this many days after upload."
  type        = number
  default     = 14

  validation {
    condition     = var.rollout_expiration_days >= 1
    error_message = "rollout_expiration_days must be at least 1."
  }
}

variable "checkpoint_expiration_days" {
  description = "Delete checkpoint files (checkpoints/) this many days after upload; 0 keeps them forever. Set it well above the longest pause of a run: the checkpoint the manifest points to must not expire."
  type        = number
  default     = 0

  validation {
    condition     = var.checkpoint_expiration_days >= 0
    error_message = "checkpoint_expiration_days must be 0 (keep) or more."
  }
}

variable "noncurrent_version_expiration_days" {
  description = "Delete overwritten or deleted object versions (old manifests, old heartbeats, consumed rollouts) this many days after they stop being current."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be at least 1."
  }
}

variable "abort_incomplete_multipart_days" {
  description = "Abort multipart uploads left incomplete (e.g. a volunteer laptop closed mid-upload) after this many days."
  type        = number
  default     = 2

  validation {
    condition     = var.abort_incomplete_multipart_days >= 1
    error_message = "abort_incomplete_multipart_days must be at least 1."
  }
}

variable "force_destroy" {
  description = "Allow terraform destroy to delete a bucket that still holds objects."
  type        = bool
  default     = false
}

variable "tags" {
  description = "Extra tags for every resource."
  type        = map(string)
  default     = {}
}
